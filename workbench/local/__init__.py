"""The local lab: the demo launcher (N real peers on this machine) and network namespaces
with capped links (:mod:`.netlab`), for demos, tests and benchmarks."""
