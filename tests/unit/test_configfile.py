"""Config files and WORKBENCH_* variables under the CLI's flags (workbench.cli.configfile)."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.errors import SwarmError
from workbench.cli.command import apply_settings, build_config, build_parser, main
from workbench.cli.configfile import ConfigError, read_file


def resolve(argv: list[str], monkeypatch=None, **environ: str):
    """(RunConfig, sources) for `workbench argv...` with only ``environ`` as WORKBENCH_* vars."""
    if monkeypatch is not None:
        for key in [k for k in __import__("os").environ if k.startswith("WORKBENCH_")]:
            monkeypatch.delenv(key)
        for key, value in environ.items():
            monkeypatch.setenv(key, value)
    parser = build_parser()
    args = parser.parse_args(argv)
    sources = apply_settings(parser, args, argv)
    return build_config(args), sources


@pytest.fixture
def run_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "tiny"\n'
        "rounds = 7\n"
        "[diloco]\ninner_steps = 20\nouter_lr = 0.5\nupdate_codec = 'int8'\nerror_feedback = true\n"
        '[network]\nannounce = ["/ip4/203.0.113.7/tcp/31337"]\nport = 31337\n'
        "peers = 8  # the demo's: ignored by start\n"
    )
    return path


def test_flag_beats_file_beats_env_beats_default(run_toml, monkeypatch):
    config, sources = resolve(
        ["start", "--config", str(run_toml), "--outer-lr", "0.3"],
        monkeypatch,
        WORKBENCH_INNER_STEPS="99",  # below the file: loses
        WORKBENCH_INNER_LR="0.002",  # nothing above it: wins
    )
    assert config.diloco.outer_lr == 0.3 and sources["outer_lr"] == "flag"
    assert config.diloco.inner_steps == 20 and sources["inner_steps"] == f"file {run_toml}"
    assert config.train.inner_lr == 0.002 and sources["inner_lr"] == "env WORKBENCH_INNER_LR"
    assert config.averaging.matchmaking_time == 2.0 and sources["matchmaking_time"] == "default"
    assert config.diloco.error_feedback is True
    assert config.network.announce == ["/ip4/203.0.113.7/tcp/31337"]
    assert config.peer.rounds == 7


def test_env_alone_and_switches(monkeypatch):
    config, sources = resolve(
        ["start"],
        monkeypatch,
        WORKBENCH_ROUNDS="4",
        WORKBENCH_ERROR_FEEDBACK="yes",
        WORKBENCH_UPDATE_CODEC="fp16",
    )
    assert config.peer.rounds == 4 and config.diloco.error_feedback is True
    assert sources["rounds"] == "env WORKBENCH_ROUNDS"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("inner_step = 3\n", "unknown key 'inner_step' (did you mean inner_steps?)"),
        ('inner_steps = "3"\n', "inner_steps must be an integer (like --inner-steps), got str '3'"),
        ("inner_steps = 2.5\n", "inner_steps must be an integer"),
        ("outer_lr = true\n", "outer_lr must be a number"),
        ('error_feedback = "yes"\n', "error_feedback must be true or false"),
        ('codec = "zip"\n', "codec = 'zip' is not one of fp16, int8, none"),
        ('model = "huge"\n', "model = 'huge': unknown model 'huge' (no such preset or folder)"),
        ("inner_steps = \n", "is not valid TOML"),
        ("[a.b]\nc = 1\n", "nested too deep"),
        ("rounds = 1\n[peer]\nrounds = 2\n", "'rounds' is set twice"),
        ("zzzz = 1\n", "unknown key 'zzzz' (see `workbench config keys`)"),
        ('"inner\\nsteps" = 3\n', "unknown key 'inner\\nsteps' (did you mean inner_steps?)"),  # one line
        ("inner_steps = " + "9" * 5000 + "\n", "a number is too long"),
        # A review (stop 69): an int too large for a float was a traceback (OverflowError, exit 1).
        ("seed = " + "9" * 400 + "\n", "seed must be in [0, 2147483647] (got an integer of 400 digits)"),
        # ...and a table named after a setting set what it held instead, without a word.
        ("outer_lr = { inner_steps = 5 }\n", "outer_lr is a setting, not a table"),
    ],
)
def test_file_errors_name_the_file_key_and_fix(tmp_path, text, message):
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as caught:
        resolve(["start", "--config", str(path)])
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_file(tmp_path / "missing.toml")
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_file(tmp_path / "binary.toml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        read_file(tmp_path)  # a folder


def test_a_huge_integer_is_one_line_by_every_route(tmp_path, monkeypatch, capsys):
    """A review (stop 69): ``math.isfinite`` of an int too large for a float raised
    OverflowError out of every bound's check: a traceback and exit 1 from a flag, a file, a
    variable, ``Experiment`` and `steer`."""
    from workbench.notebook.experiment import Experiment

    huge = "9" * 400
    assert main(["start", "--inner-steps", huge]) == 2
    assert "--inner-steps: must be in [1, 100000] (got an integer of 400 digits)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"WORKBENCH_BATCH_SIZE.*must be in \[1, 65536\]"):
        resolve(["start"], monkeypatch, WORKBENCH_BATCH_SIZE=huge)
    for value in (10**400, 10**5000):  # (past 4,300 digits Python would not even write it)
        with pytest.raises(ValueError, match=r"inner_steps must be in \[1, 100000\] \(got an integer of"):
            Experiment(inner_steps=value)
    assert (
        main(
            [
                "steer",
                "/ip4/127.0.0.1/tcp/1/p2p/QmXyzB8iV6WGF5CqH3HbXiFNPbYcvMk1pW6uDSpBX3mJ5U",
                "--from-step",
                huge,
            ]
        )
        == 2
    )
    assert "got an integer of 400 digits" in capsys.readouterr().err


def test_a_negative_value_in_any_form_reaches_its_check(capsys):
    """A review (stop 69): argparse takes ``-1e-3``, ``-inf`` or ``-nan`` for a flag, and said
    "expected one argument", hiding that the value is out of bounds."""
    for flag, value, said in [
        ("--inner-lr", "-1e-3", "--inner-lr: must be in (0, 1) (got -0.001)"),
        ("--outer-lr", "-inf", "--outer-lr: must be in (0, 10] (got -inf)"),
        ("--round-seconds", "-nan", "--round-seconds: must be in [0, 86400] (got nan)"),
        ("--inner-steps", "-5", "--inner-steps: must be in [1, 100000] (got -5)"),
    ]:
        assert main(["start", flag, value]) == 2
        assert said in capsys.readouterr().err
    from workbench.cli.options import attach_dash_values

    assert attach_dash_values(["start", "--outer-lr", "-1e-3", "--", "--x", "-1e-3"]) == [
        "start", "--outer-lr=-1e-3", "--", "--x", "-1e-3",
    ]  # fmt: skip


def test_a_switch_a_file_or_variable_sets_is_undone_by_its_no_flag(tmp_path, monkeypatch):
    """A review (stop 69): --overlap, --streaming and --client-mode had no ``--no-`` form, so
    ``overlap = true`` in a file (docs/configuration.md's example) or WORKBENCH_OVERLAP could
    not be overridden by a flag, as every other setting can."""
    path = tmp_path / "run.toml"
    path.write_text("overlap = true\nstreaming = true\nclient_mode = true\n")
    config, sources = resolve(
        ["join", "/ip4/127.0.0.1/tcp/1/p2p/QmXyzB8iV6WGF5CqH3HbXiFNPbYcvMk1pW6uDSpBX3mJ5U", "--config", str(path),
         "--no-overlap", "--no-streaming", "--no-client-mode"],
        monkeypatch,
    )  # fmt: skip
    assert not config.diloco.overlap and not config.data.streaming and not config.network.client_mode
    assert sources["overlap"] == sources["streaming"] == sources["client_mode"] == "flag"
    config, _ = resolve(["start", "--no-overlap"], monkeypatch, WORKBENCH_OVERLAP="1")
    assert not config.diloco.overlap
    # Off is no flag at all in a join command rebuilt from a config (not --no-overlap).
    from workbench.cli.argv import setting_arguments

    assert setting_arguments(config, ["overlap", "client_mode"]) == []
    # Off is off where the switch has no use: not refused as if it were on (a first version).
    path.write_text('method = "dp"\noverlap = false\n')
    assert resolve(["start", "--config", str(path)], monkeypatch)[0].method == "dp"
    assert resolve(["start", "--method", "streaming", "--no-overlap"], monkeypatch)[0].method == "streaming"


def test_the_demo_s_display_switches_from_a_file_or_variable_are_undone_by_a_flag(tmp_path, monkeypatch):
    """`headless = true` (or WORKBENCH_HEADLESS) and `no_tui = true` had no flag to undo them,
    against docs/configuration.md's promise (a review, stop 72): --no-headless and --tui."""
    path = tmp_path / "demo.toml"
    path.write_text("headless = true\nno_tui = true\n")
    for key in [k for k in __import__("os").environ if k.startswith("WORKBENCH_")]:
        monkeypatch.delenv(key)
    parser = build_parser()
    for argv, expected in [
        (["demo", "--config", str(path)], (True, True)),
        (["demo", "--config", str(path), "--no-headless", "--tui"], (False, False)),
    ]:
        args = parser.parse_args(argv)
        apply_settings(parser, args, argv)
        assert (args.headless, args.no_tui) == expected, argv
    monkeypatch.setenv("WORKBENCH_HEADLESS", "1")
    args = parser.parse_args(["demo", "--no-headless"])
    apply_settings(parser, args, ["demo", "--no-headless"])
    assert args.headless is False


def test_a_config_file_saved_with_a_byte_order_mark_reads(tmp_path):
    """Notepad's UTF-8 starts with a byte-order mark: "not valid TOML (at line 1, column 1)"."""
    path = tmp_path / "run.toml"
    path.write_bytes(b"\xef\xbb\xbfinner_steps = 7\n")
    assert read_file(path) == {"inner_steps": 7}


def test_bad_environment_values(monkeypatch):
    with pytest.raises(ConfigError, match="WORKBENCH_INNER_STEPS='many' must be an integer"):
        resolve(["start"], monkeypatch, WORKBENCH_INNER_STEPS="many")
    with pytest.raises(ConfigError, match="WORKBENCH_CLIENT_MODE='maybe': use 1/0"):
        resolve(["start"], monkeypatch, WORKBENCH_CLIENT_MODE="maybe")


def test_a_bad_value_is_refused_even_where_a_flag_overrides_it(tmp_path, monkeypatch):
    """The flag wins, but the file (or variable) is still wrong: the next command without the
    flag would take it. Refused now, naming the file and key, not at that later command."""
    path = tmp_path / "run.toml"
    path.write_text("outer_lr = -1\n")
    with pytest.raises(ConfigError, match=f"{path}: outer_lr = -1"):
        resolve(["start", "--config", str(path), "--outer-lr", "0.5"], monkeypatch)
    with pytest.raises(ConfigError, match="WORKBENCH_INNER_STEPS='many' must be an integer"):
        resolve(["start", "--inner-steps", "5"], monkeypatch, WORKBENCH_INNER_STEPS="many")
    # Text the run checks as it is built (a host, a run id, a name, an owner, a secret): the
    # file's was read as a string only, and a flag over it hid it (a review, 2026-12-06).
    for text, flag, said in (
        ('host = "not-an-ip"\n', ["--host", "127.0.0.1"], "host = 'not-an-ip': --host must be an IP"),
        ('run_id = "bad id"\n', ["--run-id", "good"], "run_id = 'bad id': invalid run id"),
        ('name = ""\n', ["--name", "ok"], "name = '': invalid peer name"),
        ('owner = "xyz"\n', ["--owner", "0123456789abcdef"], "owner = 'xyz': --owner takes the 16 hex"),
        ('secret = "short"\n', ["--secret", "long enough"], "secret = (set, not shown): a run secret must"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=None) as caught:
            resolve(["start", "--config", str(path), *flag], monkeypatch)
        assert f"{path}: {said}" in str(caught.value)
    with pytest.raises(ConfigError, match="WORKBENCH_HOST = 'bogus': --host must be an IP"):
        resolve(["start", "--host", "127.0.0.1"], monkeypatch, WORKBENCH_HOST="bogus")
    path.write_text("outer_lr = 0.9\n")  # a good value under a flag: the flag still wins
    config, sources = resolve(["start", "--config", str(path), "--outer-lr", "0.5"], monkeypatch)
    assert config.diloco.outer_lr == 0.5 and sources["outer_lr"] == "flag"


def test_an_empty_config_path_is_refused(monkeypatch, capsys):
    with pytest.raises(ConfigError, match="--config is empty"):
        resolve(["start", "--config", ""], monkeypatch)
    assert main(["start", "--config", ""]) == 2
    assert "--config is empty: give the path of a TOML file" in capsys.readouterr().err


def test_a_range_error_names_where_the_value_came_from(tmp_path, capsys, monkeypatch):
    path = tmp_path / "run.toml"
    path.write_text("inner_lr = 5\n")
    assert main(["start", "--config", str(path)]) == 2
    # Checked with the flag's own bounds (swarm.bounds) while the file is read: file, key, value.
    assert f"{path}: inner_lr = 5: must be in (0, 1)" in capsys.readouterr().err


def test_config_show_sources_and_json(run_toml, capsys, monkeypatch):
    monkeypatch.delenv("WORKBENCH_INNER_LR", raising=False)
    assert main(["config", "show", "--config", str(run_toml), "--rounds", "3", "--sources"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("inner_steps = 20") and line.endswith(f"# file {run_toml}") for line in lines)
    assert any(line.startswith("rounds = 3") and line.endswith("# flag") for line in lines)
    assert main(["config", "show", "--config", str(run_toml), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["settings"]["outer_lr"] == 0.5 and shown["sources"]["model"] == f"file {run_toml}"


def test_config_show_output_is_a_config_file(run_toml, tmp_path, capsys):
    """`workbench config show > resolved.toml` round-trips to the same settings."""
    assert main(["config", "show", "--config", str(run_toml)]) == 0
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(capsys.readouterr().out)
    first, _ = resolve(["start", "--config", str(run_toml)])
    again, _ = resolve(["start", "--config", str(resolved)])
    assert first == again


def test_config_show_keeps_a_switch_turned_off_over_a_variable_s_on(tmp_path, capsys, monkeypatch):
    """`--no-overlap` beside WORKBENCH_OVERLAP=yes: `config show` printed `# overlap = false`,
    commented out as the method's preset, so the file it saved lost the flag and the variable
    turned overlap back on (a review, stop 72)."""
    monkeypatch.setenv("WORKBENCH_OVERLAP", "yes")
    assert main(["config", "show", "--no-overlap", "--sources"]) == 0
    shown = capsys.readouterr().out
    assert any(
        line.startswith("overlap = false") and line.endswith("# flag") for line in shown.splitlines()
    ), shown
    assert main(["config", "show", "--no-overlap"]) == 0
    saved = tmp_path / "saved.toml"
    saved.write_text(capsys.readouterr().out)
    config, _ = resolve(["start", "--config", str(saved)], monkeypatch, WORKBENCH_OVERLAP="yes")
    assert not config.diloco.overlap


def test_config_show_takes_a_joiners_file_as_join_does(tmp_path, capsys):
    """A joiner's file (``client_mode = true``) was refused by `config show` with start's rule
    ("the first peer of a run must accept connections") while `join --config` took it (a review,
    stop 71); `start` still refuses it."""
    joiner = tmp_path / "joiner.toml"
    joiner.write_text("client_mode = true\n")
    assert main(["config", "show", "--config", str(joiner)]) == 0
    assert "client_mode = true" in capsys.readouterr().out
    assert main(["start", "--config", str(joiner)]) == 2
    assert "the first peer of a run must accept connections" in capsys.readouterr().err


def test_config_show_writes_text_with_a_newline_as_toml_reads_it(tmp_path, capsys):
    """A --tokenizer path holding a newline was written between plain quotes over two lines,
    which TOML refuses: `config show > resolved.toml` could not be read back."""
    assert main(["config", "show", "--tokenizer", '/x\ny\t"z\\\x7f']) == 0  # DEL: TOML refuses it bare
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(capsys.readouterr().out)
    assert read_file(resolved)["tokenizer"] == '/x\ny\t"z\\\x7f'


def test_config_show_gives_the_values_of_the_method_s_preset(tmp_path, capsys):
    """Left unset, an optimizer setting takes the method's preset: `config show --method
    sparseloco` printed `# update_codec =` for its topk codec, and `fragments: null` for streaming's
    5. The values are shown (and said to be the preset's), left commented out so the file keeps
    following the method it names; knobs the run would not use (topk's without topk) stay bare."""
    assert main(["config", "show", "--method", "sparseloco", "--sources"]) == 0
    lines = capsys.readouterr().out.splitlines()
    shown = {line.split("=")[0].strip("# ").strip(): line for line in lines}
    assert shown["update_codec"].startswith('# update_codec = "topk"')
    assert shown["update_codec"].endswith("# preset of --method sparseloco")
    assert shown["ef_decay"].startswith("# ef_decay = 0.95") and shown["topk_mean"].startswith(
        '# topk_mean = "kept"'
    )
    assert main(["config", "show", "--method", "streaming", "--json"]) == 0
    streaming = json.loads(capsys.readouterr().out)
    assert streaming["settings"]["fragments"] is None and streaming["preset"]["fragments"] == 5
    assert streaming["sources"]["fragments"] == "preset of --method streaming"
    assert "topk_density" not in streaming["preset"]  # the update codec is none: nothing to shape
    assert main(["config", "show", "--method", "sparseloco"]) == 0
    saved = tmp_path / "resolved.toml"
    saved.write_text(capsys.readouterr().out)
    assert resolve(["start", "--config", str(saved)])[0] == resolve(["start", "--method", "sparseloco"])[0]


def test_another_command_s_keys_are_checked_though_this_one_skips_them(tmp_path, monkeypatch, capsys):
    """One file and one environment serve start, join, demo and simulate, and each command skips
    the others' keys: `config show` and `start` passed `peers = "eight"` (demo's), simulate passed
    `rounds = -1`, `WORKBENCH_ROUNDS=-1` and the peers' `codec = "zip"`. Each is refused now, by
    every command, naming where it came from; a good value is still skipped."""
    path = tmp_path / "run.toml"
    path.write_text('peers = "eight"\n')
    with pytest.raises(ConfigError, match=f"{path}: peers must be an integer"):
        resolve(["start", "--config", str(path)], monkeypatch)
    path.write_text('codec = "zip"\n')
    assert main(["simulate", "--config", str(path)]) == 2
    assert f"{path}: codec = 'zip' is not one of fp16, int8, none" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="WORKBENCH_ROUNDS='-1': must be in"):
        resolve(["config", "show"], monkeypatch, WORKBENCH_ROUNDS="-1")  # also checked for simulate below
    monkeypatch.setenv("WORKBENCH_ROUNDS", "-1")
    assert main(["simulate", "--steps", "4"]) == 2
    assert "WORKBENCH_ROUNDS='-1': must be in" in capsys.readouterr().err
    path.write_text("peers = 3\nsteps = 4\n")  # demo's and simulate's: start skips them
    assert resolve(["start", "--config", str(path)], monkeypatch)[0].peer.rounds == 0


def test_config_keys_lists_every_setting(capsys):
    assert main(["config", "keys", "--json"]) == 0
    keys = json.loads(capsys.readouterr().out)
    assert keys["inner_steps"]["flag"] == "--inner-steps"
    assert keys["peers"]["commands"] == ["demo", "simulate"]
    # A switch's own flag, help and default, not its --no- form's (eager read as its opposite).
    assert keys["eager"]["flag"] == "--eager" and keys["eager"]["default"] is None
    assert "naive" not in keys["eager"]["help"]


_values = st.one_of(
    st.integers(),
    st.floats(allow_nan=False),
    st.booleans(),
    st.text(max_size=20),
    st.lists(st.text(max_size=5), max_size=3),
)


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["inner_steps", "outer_lr", "codec", "announce", "error_feedback", "x"]), _values
    )
)
def test_fuzz_file_values_parse_or_raise_config_errors(tmp_path_factory, values):
    from workbench.cli.configfile import to_toml

    path = tmp_path_factory.mktemp("fuzz") / "run.toml"
    path.write_text(to_toml(values))
    # ConfigError, the config tree's range checks, a bad address: nothing else
    with contextlib.suppress(ValueError, SwarmError):
        resolve(["start", "--config", str(path)])


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_fuzz_toml_text_parses_or_raises_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "run.toml"
    path.write_text(text, encoding="utf-8")
    with contextlib.suppress(ConfigError):
        read_file(path)


def test_a_negated_switch_is_a_key_named_after_the_setting(tmp_path, monkeypatch):
    """``eager = false`` is ``--no-eager``; ``Experiment(eager=False)`` too."""
    from workbench.notebook.experiment import config_from_flags

    path = tmp_path / "run.toml"
    path.write_text("overlap = true\neager = false\n")
    config, _ = resolve(["start", "--config", str(path)], monkeypatch)
    assert config.diloco.overlap is True and config.diloco.eager is False
    assert config.diloco.outer_momentum == 0.0  # the naive delay's default
    config, _ = config_from_flags("demo", overlap=True, eager=False)
    assert config.diloco.eager is False and config.diloco.outer_momentum == 0.0
    path.write_text("overlap = true\neager = true\n")
    assert resolve(["start", "--config", str(path)], monkeypatch)[0].diloco.eager is True


def test_a_key_the_run_would_ignore_is_refused_as_its_flag_is(tmp_path, monkeypatch):
    """``topk_chunk`` without the topk codec, ``ef_decay`` without error feedback, ``inner_steps``
    for dp: refused from a file (and as Experiment keywords), as on the command line."""
    from workbench.notebook.experiment import config_from_flags

    path = tmp_path / "run.toml"
    path.write_text("[diloco]\ntopk_chunk = 64\n")
    with pytest.raises(ValueError, match="add --update-codec topk"):
        resolve(["start", "--config", str(path)], monkeypatch)
    path.write_text("[diloco]\nupdate_codec = 'topk'\ntopk_chunk = 64\n")
    assert resolve(["start", "--config", str(path)], monkeypatch)[0].diloco.topk_chunk == 64
    path.write_text("ef_decay = 0.9\n")
    with pytest.raises(ValueError, match="error feedback is off"):
        resolve(["start", "--config", str(path)], monkeypatch)
    path.write_text("inner_steps = 10\n")
    with pytest.raises(ValueError, match="--method dp cannot use --inner-steps"):
        resolve(["start", "--method", "dp", "--config", str(path)], monkeypatch)
    with pytest.raises(ValueError, match="add --error-feedback"):
        config_from_flags("demo", ef_decay=0.9)


def test_simulate_reads_the_same_file_as_the_peers(tmp_path, capsys, monkeypatch, caplog):
    """One run.toml: simulate takes its optimizer and model keys (a flag still wins) and skips
    the peers' own (``announce``); start skips simulate's own (``steps``)."""
    import json

    for key in [k for k in __import__("os").environ if k.startswith("WORKBENCH_")]:
        monkeypatch.delenv(key)
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "tiny"\nsteps = 8\nbatch_size = 4\npeers = 2\n'
        "[diloco]\ninner_steps = 4\nouter_lr = 0.5\nouter_momentum = 0.3\n"
        '[network]\nannounce = ["/ip4/203.0.113.7/tcp/31337"]\nport = 31337\n[averaging]\ncodec = "int8"\n'
    )
    assert main(["simulate", "--config", str(path), "--outer-lr", "0.6", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # The wire codec is a peer's: skipped, and said (simulate's --codec is its update codec).
    assert "simulate skips codec = 'int8'" in caplog.text and result["codec"] == "none", caplog.text
    assert (result["steps"], result["peers"], result["inner_steps"]) == (8, 2, 4)
    assert result["config"]["outer_lr"] == 0.6 and result["config"]["outer_momentum"] == 0.3
    config, sources = resolve(["start", "--config", str(path)], monkeypatch)
    assert config.diloco.outer_lr == 0.5 and "steps" not in sources
    path.write_text("inner_stepz = 4\n")
    assert main(["simulate", "--config", str(path)]) == 2
    assert "unknown key 'inner_stepz' (did you mean inner_steps?)" in capsys.readouterr().err


def test_simulates_speeds_as_a_toml_list(tmp_path):
    """Stop 57, a review: docs/configuration.md says values keep TOML's types, and `Experiment`
    takes speeds as a list; the file's `speeds = [1, 1]` was refused (only "1,1" passed)."""
    from workbench.settings import settings
    from workbench.settings.simulate import Bench

    speeds = next(s for s in settings(Bench) if s.key == "speeds")
    assert speeds.check([1, 1, 0.5], "run.toml: speeds") == "1,1,0.5"
    assert speeds.check("1,1", "run.toml: speeds") == "1,1"
    with pytest.raises(ValueError, match="a list of numbers"):
        speeds.check([1, True], "run.toml: speeds")


@pytest.mark.parametrize(
    "line, said",
    [
        ('speeds = "1,abc"', "positive numbers separated by commas"),
        ('speeds = ""', "positive numbers separated by commas"),
        ('speeds = "nan,1"', "positive numbers separated by commas"),
        ('straggler = ["abc"]', "RANK:FRACTION"),
    ],
)
def test_simulates_speeds_and_stragglers_are_checked_by_every_command_that_reads_the_file(
    tmp_path, capsys, line, said
):
    """Checked only by `simulate`, ``speeds = "1,abc"`` passed `config show` (and start, join,
    demo), and ``speeds = ""`` was taken as none (a review, stop 71)."""
    path = tmp_path / "run.toml"
    path.write_text(line + "\n")
    for command in (["config", "show"], ["simulate", "--steps", "1"]):
        assert main([*command, "--config", str(path)]) == 2, command
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
