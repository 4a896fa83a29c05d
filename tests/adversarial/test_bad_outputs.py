"""Where a build writes: no user file is ever replaced, and nothing half-done looks complete."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from corpus import dead_pid, image_tree, leftover_name, snapshot

from ddpkit.cli import main
from ddpkit.data import ImageError, LazyLMDBDataset, build_lmdb
from ddpkit.data.lmdb_format import open_env


def _build_cli(source: Path, output: Path | str, *extra: str) -> int:
    return main(["lmdb", "build", str(source), str(output), "--no-progress", *extra])


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_regular_file_at_the_output_is_never_replaced(
    tmp_path: Path, overwrite: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = image_tree(tmp_path / "imgs")
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    assert _build_cli(tree, notes, *(["--overwrite"] if overwrite else [])) == 1
    assert notes.read_text() == "my notes"
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert "Traceback" not in err
    assert str(notes) in err


@pytest.mark.parametrize("kind", ["list", "parquet"])
def test_the_source_is_never_the_output(tmp_path: Path, kind: str) -> None:
    tree = image_tree(tmp_path / "imgs")
    if kind == "list":
        source = tmp_path / "list.txt"
        source.write_text("".join(f"{p},{p.parent.name[1]}\n" for p in sorted(tree.rglob("*.jpg"))))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = tmp_path / "x.parquet"
        files = sorted(tree.rglob("*.jpg"))
        pq.write_table(
            pa.table({"image": [f.read_bytes() for f in files], "label": [0] * len(files)}),
            source,
        )
    before = snapshot(source)
    with pytest.raises(ValueError, match="is the source"):
        build_lmdb(source, source, overwrite=True, progress=False)
    assert snapshot(source) == before


def test_an_output_inside_the_source_is_refused_before_any_work(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs")
    before = snapshot(tree)
    for inside in (tree / "train.lmdb", tree / "c0" / "db"):
        with pytest.raises(ValueError, match="inside the source"):
            build_lmdb(tree, inside, progress=False)
    assert snapshot(tree) == before
    assert sorted(p.name for p in tree.iterdir()) == ["c0", "c1"]


@pytest.mark.parametrize("empty", ["", " "])
def test_empty_paths_are_refused(tmp_path: Path, empty: str) -> None:
    tree = image_tree(tmp_path / "imgs")
    with pytest.raises(ValueError, match="output path is empty"):
        build_lmdb(tree, empty, progress=False)
    with pytest.raises(ValueError, match="source path is empty"):
        build_lmdb(empty, tmp_path / "db", progress=False)


def test_the_output_directory_must_exist(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_lmdb(tree, tmp_path / "missing" / "db", progress=False)


def test_only_an_lmdb_directory_is_overwritten(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs")
    db = tmp_path / "db"
    build_lmdb(tree, db, progress=False)
    build_lmdb(tree, db, overwrite=True, progress=False)  # a database: replaced
    assert len(LazyLMDBDataset(db)) == 6

    cases = {}
    mixed = tmp_path / "mixed"  # an LMDB, but the user keeps other files in it
    build_lmdb(tree, mixed, progress=False)
    (mixed / "my-results.csv").write_text("keep me")
    cases[mixed] = "my-results.csv beside data.mdb"
    fake = tmp_path / "fake"  # a data.mdb that is not LMDB
    fake.mkdir()
    (fake / "data.mdb").write_bytes(b"not lmdb" * 100)
    cases[fake] = "no LMDB header"
    link = tmp_path / "link"  # a link to a database: the link is not ours to replace
    link.symlink_to(db)
    cases[link] = "symbolic link"
    for output, reason in cases.items():
        before = snapshot(output)
        with pytest.raises(FileExistsError, match=reason):
            build_lmdb(tree, output, overwrite=True, progress=False)
        assert snapshot(output) == before, output


def test_a_build_that_stores_nothing_fails_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    for k in range(2):
        (broken / f"c{k}").mkdir(parents=True)
        (broken / f"c{k}" / "x.jpg").write_bytes(b"not a jpeg")
    assert _build_cli(broken, tmp_path / "db", "--on-error", "skip") == 1
    assert "no image of" in capsys.readouterr().err
    assert not (tmp_path / "db").exists()
    assert list(tmp_path.glob("db.tmp-*")) == []
    assert _build_cli(broken, tmp_path / "db", "--on-error", "skip", "--allow-empty") == 0
    assert len(LazyLMDBDataset(tmp_path / "db")) == 0


def test_a_symlink_loop_neither_multiplies_nor_hangs(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs")
    (tree / "c0" / "loop").symlink_to(tree / "c0")  # c0/loop/loop/... would repeat c0
    (tree / "c1" / "up").symlink_to(tree)  # up/c0, up/c1 ... would repeat everything
    with pytest.raises(ImageError, match=r"a link to .*already read"):
        build_lmdb(tree, tmp_path / "db", progress=False)
    assert not (tmp_path / "db").exists()
    summary = build_lmdb(tree, tmp_path / "db", on_error="skip", progress=False)
    assert summary.samples == 6
    assert sorted(Path(where).name for where, _ in summary.skipped) == ["loop", "up"]


def test_a_second_link_to_a_class_directory_is_reported(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs")
    (tree / "c2").symlink_to(tree / "c0")  # a class that is another class's directory
    summary = build_lmdb(tree, tmp_path / "db", on_error="skip", progress=False)
    assert summary.samples == 6
    assert [Path(where).name for where, _ in summary.skipped] == ["c2"]


def test_leftovers_of_killed_builds_are_removed_after_the_next_build(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs")
    db = tmp_path / "db"
    dead, alive = dead_pid(), os.getppid()
    stale = [leftover_name(db, "tmp", dead), leftover_name(db, "old", dead)]
    kept = [leftover_name(db, "tmp", alive), tmp_path / "db.tmp-otherhost-1-0123abcd"]
    for path in stale + kept:
        path.mkdir()
        (path / "data.mdb").write_bytes(b"x" * 1000)
    build_lmdb(tree, db, progress=False)
    assert [p.exists() for p in stale] == [False, False]
    assert [p.exists() for p in kept] == [True, True]  # a live process, another host


def test_a_database_left_by_an_interrupted_swap_is_named(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs")
    db = tmp_path / "db"
    build_lmdb(tree, db, progress=False)
    aside = leftover_name(db, "old", dead_pid())
    db.rename(aside)  # what a kill between the two renames of an --overwrite leaves
    with pytest.raises(FileNotFoundError, match=f"left a database at {aside}"):
        open_env(db)
    with pytest.raises(FileNotFoundError, match="mv "):
        LazyLMDBDataset(db)


def test_the_swap_into_place_is_one_step_where_linux_allows(tmp_path: Path) -> None:
    from ddpkit.files import exchange

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "which").write_text("a")
    (b / "which").write_text("b")
    if not exchange(a, b):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here: the two-rename fallback is used")
    assert ((a / "which").read_text(), (b / "which").read_text()) == ("b", "a")
    with pytest.raises(FileNotFoundError):
        exchange(a, tmp_path / "missing")  # both must exist; nothing moves
    assert (a / "which").read_text() == "b"


def test_what_appears_at_the_output_during_a_build_is_not_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ddpkit.data.lmdb_build as builder

    tree = image_tree(tmp_path / "imgs")
    output = tmp_path / "race.lmdb"
    finish = builder._Written.finish

    def meanwhile(self: object, *args: object) -> object:
        output.mkdir()  # another rank's build, or the user, got there first
        (output / "precious.txt").write_text("keep me")
        return finish(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(builder._Written, "finish", meanwhile)
    for overwrite in (False, True):
        with pytest.raises(FileExistsError):
            build_lmdb(tree, output, overwrite=overwrite, progress=False)
        assert (output / "precious.txt").read_text() == "keep me"
        assert sorted(p.name for p in output.iterdir()) == ["precious.txt"]
        assert list(tmp_path.glob("race.lmdb.*")) == []
        (output / "precious.txt").unlink()
        output.rmdir()


def test_a_trailing_separator_does_not_hide_a_link(tmp_path: Path) -> None:
    tree = image_tree(tmp_path / "imgs")
    db = tmp_path / "db"
    build_lmdb(tree, db, progress=False)
    link = tmp_path / "link.lmdb"
    link.symlink_to(db)
    with pytest.raises(FileExistsError, match="symbolic link"):
        build_lmdb(tree, f"{link}/", overwrite=True, progress=False)
    assert link.is_symlink()


def test_an_unfinished_build_is_not_offered_as_the_database(tmp_path: Path) -> None:
    import lmdb

    db = tmp_path / "db"
    partial = leftover_name(db, "tmp", dead_pid())
    env = lmdb.open(str(partial), map_size=1 << 20)
    with env.begin(write=True) as txn:  # records, but no index: a build cut short
        txn.put(b"\0" * 8, b"x")
    env.close()
    with pytest.raises(FileNotFoundError) as info:
        open_env(db)
    assert "left a database" not in str(info.value)
    assert "Build one with" in str(info.value)
