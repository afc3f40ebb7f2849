"""`--out` files carry the command that made their table (loadtests/record.py)."""

from loadtests.record import command_line, write_table


def test_append_keeps_earlier_tables_and_names_each_command(tmp_path):
    out = tmp_path / "results" / "x.md"
    write_table(out, "engine", ["--batch", "4"], "| a |", title="Engine benchmark")
    write_table(out, "host-step", ["--steps", "3"], "| b |")
    write_table(out, "host-step", [], "| c |")
    text = out.read_text()
    assert text.startswith("# Engine benchmark\n\nCommand: `python -m loadtests engine --batch 4`")
    assert "Command: `python -m loadtests host-step --steps 3`\n\n| b |\n" in text
    assert "Command: `python -m loadtests host-step`\n\n| c |\n" in text
    assert text.index("| a |") < text.index("| b |") < text.index("| c |")


def test_title_starts_the_file_afresh(tmp_path):
    out = tmp_path / "x.md"
    out.write_text("old table\n")
    write_table(out, "engine", [], "| new |", title="T")
    assert "old table" not in out.read_text()


def test_command_line_defaults_to_this_process_arguments(monkeypatch):
    monkeypatch.setattr("sys.argv", ["loadtests", "--rounds", "2"])
    assert command_line("host-step", None) == "python -m loadtests host-step --rounds 2"
