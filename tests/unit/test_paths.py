"""fleet/paths.py: caller-named paths stay inside the server's directories (`..`, absolute paths and
symlinks that escape fail), and the bulk-jobs service applies it to inputs, uploads and results."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from fleet.errors import InvalidInput, NotFound
from fleet.jobs.records import COMPLETED, QUEUED, RUNNING
from fleet.jobs.runner import JobOptions
from fleet.keys import Keys
from fleet.paths import contained, inside_any
from fleet.redis_server import LocalServer
from gateway.jobs import service
from gateway.jobs.service import JobsContext


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """base/{a.txt, sub/b.txt, in-link -> sub/b.txt, out-link -> ../secret, dir-out -> ..}, secret, base-evil/x."""
    base = tmp_path / "base"
    (base / "sub").mkdir(parents=True)
    (base / "a.txt").write_text("a")
    (base / "sub" / "b.txt").write_text("b")
    (tmp_path / "secret").write_text("s")
    (tmp_path / "base-evil").mkdir()
    (tmp_path / "base-evil" / "x").write_text("x")
    (base / "in-link").symlink_to(base / "sub" / "b.txt")
    (base / "out-link").symlink_to(tmp_path / "secret")
    (base / "dir-out").symlink_to(tmp_path)
    return base


# ---------------------------------------------------------------- contained


@pytest.mark.parametrize("name", ["a.txt", "sub/b.txt", "sub/../a.txt", "new-file", "sub/new/deeper", "in-link", ""])
def test_contained_accepts_paths_that_stay_inside(tree: Path, name: str) -> None:
    got = contained(tree, name)
    assert got.is_absolute() and got.is_relative_to(tree.resolve())


def test_contained_resolves_links_inside(tree: Path) -> None:
    assert contained(tree, "in-link") == (tree / "sub" / "b.txt").resolve()


@pytest.mark.parametrize("name", ["..", "../secret", "sub/../../secret", "out-link", "dir-out/secret",
                                  "dir-out/base/a.txt/../../secret", "/etc/passwd", "../base-evil/x"])
def test_contained_refuses_escapes(tree: Path, name: str) -> None:
    with pytest.raises(InvalidInput, match="outside the directory it must stay in"):
        contained(tree, name)


def test_contained_accepts_an_absolute_path_inside_and_a_relative_base(tree: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert contained(tree, tree / "a.txt") == (tree / "a.txt").resolve()
    monkeypatch.chdir(tree.parent)
    assert contained(Path("base"), "sub/b.txt") == (tree / "sub" / "b.txt").resolve()


def test_contained_through_a_linked_base(tree: Path) -> None:
    """The base itself may be a link (a mounted volume): containment is judged after resolving both."""
    link = tree.parent / "base-link"
    link.symlink_to(tree)
    assert contained(link, "a.txt") == (tree / "a.txt").resolve()
    with pytest.raises(InvalidInput):
        contained(link, "../secret")


@pytest.mark.parametrize("name", ["a\0b", "loop/x"])
def test_unresolvable_names_are_invalid_input(tree: Path, name: str) -> None:
    (tree / "loop").symlink_to(tree / "loop")
    with pytest.raises(InvalidInput):
        contained(tree, name)


# ---------------------------------------------------------------- inside_any


def test_inside_any_of_several_bases(tree: Path) -> None:
    other = tree.parent / "base-evil"
    assert inside_any([other, tree], str(tree / "sub" / "b.txt")) == (tree / "sub" / "b.txt").resolve()
    assert inside_any([tree, other], other / "x") == (other / "x").resolve()
    assert inside_any([tree], str(tree / "in-link")) == (tree / "sub" / "b.txt").resolve()


@pytest.mark.parametrize("candidate", ["{base}/../secret", "{base}/out-link", "{base}/dir-out/secret",
                                       "{root}/base-evil/x", "/etc/passwd", "{root}/secret"])
def test_inside_any_refuses_what_escapes(tree: Path, candidate: str) -> None:
    with pytest.raises(InvalidInput, match="outside the directories"):
        inside_any([tree], candidate.format(base=tree, root=tree.parent))


def test_inside_any_with_no_bases_allows_nothing(tree: Path) -> None:
    with pytest.raises(InvalidInput):
        inside_any([], tree / "a.txt")


def test_a_relative_candidate_is_relative_to_the_working_directory(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tree / "sub")
    assert inside_any([tree], "b.txt") == (tree / "sub" / "b.txt").resolve()
    with pytest.raises(InvalidInput):
        inside_any([tree], "../../secret")


# ---------------------------------------------------------------- the jobs service


@pytest.fixture
def ctx(redis_server: LocalServer, key_prefix: str, tree: Path) -> Iterator[JobsContext]:
    client = redis.Redis.from_url(redis_server.url, protocol=2)
    jobs_dir = tree.parent / "jobs"
    (jobs_dir / "uploads").mkdir(parents=True)
    yield JobsContext(client, Keys(key_prefix), jobs_dir.resolve(),
                      JobOptions(key_prefix, [], window_rows=16, lease_ms=1000), input_dirs=(tree.resolve(),))
    client.close()


def test_job_inputs_come_from_uploads_or_the_input_dirs(ctx: JobsContext, tree: Path) -> None:
    uploaded = ctx.jobs_dir / "uploads" / "abc123.jsonl"
    uploaded.write_text("{}\n")
    (ctx.jobs_dir / "uploads" / "abc123.jsonl.part").write_text("")
    assert service._input_path(ctx, {"upload": "abc123"}) == uploaded
    assert service._input_path(ctx, str(uploaded)) == uploaded  # the uploads dir, named by path
    assert service._input_path(ctx, str(tree / "a.txt")) == (tree / "a.txt").resolve()
    assert service._input_path(ctx, str(tree / "in-link")) == (tree / "sub" / "b.txt").resolve()


@pytest.mark.parametrize("candidate", ["{root}/secret", "{base}/../secret", "{base}/out-link", "{base}/dir-out/secret",
                                       "{root}/jobs/../secret", "/etc/passwd", "{root}/base-evil/x"])
def test_job_inputs_elsewhere_are_refused_with_the_way_out(ctx: JobsContext, tree: Path, candidate: str) -> None:
    with pytest.raises(InvalidInput, match="outside the directories jobs may read.*FLEET_JOB_INPUT_DIRS"):
        service._input_path(ctx, candidate.format(base=tree, root=tree.parent))


def test_without_input_dirs_only_uploads_are_readable(ctx: JobsContext, tree: Path) -> None:
    only_uploads = JobsContext(ctx.client, ctx.keys, ctx.jobs_dir, ctx.options)
    with pytest.raises(InvalidInput, match="outside"):
        service._input_path(only_uploads, str(tree / "a.txt"))


@pytest.mark.parametrize("token", ["../x", "a/b", "*", "abc?", "ab c", "²", "", "abc123.jsonl"])
def test_upload_tokens_are_plain_ascii_alphanumerics(ctx: JobsContext, token: str) -> None:
    (ctx.jobs_dir / "uploads" / "abc123.jsonl").write_text("{}\n")
    with pytest.raises(InvalidInput, match="upload"):
        service._input_path(ctx, {"upload": token})


@pytest.mark.parametrize("name", ["../../etc/x.jsonl", "/abs/x.npy", "..\\x.NPZ", "a/../../b.ndjson"])
def test_upload_names_choose_only_the_suffix(ctx: JobsContext, name: str) -> None:
    token, path, gzipped = service.upload_path(ctx, name)
    assert token.isalnum() and path.parent == ctx.jobs_dir / "uploads" and not gzipped
    assert path.name == token + Path(name).suffix.lower()
    token, path, gzipped = service.upload_path(ctx, name + ".gz")  # stored decompressed, as the inner type
    assert gzipped and path.name == token + Path(name).suffix.lower()


@pytest.mark.parametrize("name", ["x.sh", "x.jsonl/..", "..", "", "x.jsonl.part", "x.gz", "x.sh.gz"])
def test_upload_names_without_a_data_suffix_are_refused(ctx: JobsContext, name: str) -> None:
    with pytest.raises(InvalidInput, match="unsupported upload type"):
        service.upload_path(ctx, name)


def test_results_are_served_only_from_the_jobs_dir(ctx: JobsContext, tree: Path) -> None:
    fields = {"model": "m", "version": 1, "priority": 0, "input": "/x.npy", "input_kind": "array",
              "output_format": "npy", "max_failures": -1}
    inside = ctx.jobs_dir / "good" / "output.npy"
    for job_id, output in (("good", inside), ("edited", tree.parent / "secret"),
                           ("dotted", ctx.jobs_dir / ".." / "secret")):
        assert ctx.store.create(job_id, {**fields, "output": str(output)})
        assert ctx.store.transition(job_id, RUNNING, (QUEUED,))
        assert ctx.store.transition(job_id, COMPLETED, (RUNNING,))
    assert service.results_path(ctx, "good") == (inside, "npy")
    for job_id in ("edited", "dotted"):
        with pytest.raises(NotFound, match="not in this gateway's jobs directory"):
            service.results_path(ctx, job_id)
    with pytest.raises(NotFound):
        service.results_path(ctx, "../good")


def test_settings_read_job_input_dirs_from_a_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.settings import Settings

    monkeypatch.setenv("FLEET_JOB_INPUT_DIRS", '["/data/in", "rel/dir"]')
    assert Settings().job_input_dirs == (Path("/data/in"), Path("rel/dir"))
    monkeypatch.delenv("FLEET_JOB_INPUT_DIRS")
    assert Settings().job_input_dirs == ()
