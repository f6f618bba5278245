"""What every "refused before any work" case of a command line checks."""


def assert_refused_first(main, argv: list[str], message: str, tmp_path, capsys) -> None:
    """`main(argv)` ({tmp} = tmp_path) exits 2 with one line naming `message`, and the user's file X.md is untouched."""
    (tmp_path / "X.md").write_text("mine")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert (tmp_path / "X.md").read_text() == "mine"  # nothing of the user's was touched
