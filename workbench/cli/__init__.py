"""The ``workbench`` command line: :mod:`.command` builds the parser and dispatches; the peer
commands' flags live in :mod:`.options` (and back from a config in :mod:`.argv`), every other
command in its own module (``status``, ``steer``, ``doctor``, ``monitor``, ``simulate``,
``config``, ``export``, ``completion``)."""

from workbench.cli.command import main

__all__ = ["main"]
