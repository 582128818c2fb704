"""Local runs keep their log folder, and prune the folders of older finished runs (issue 35 item 10)."""

import os
import tempfile

from afd.local.children import LocalProcesses
from afd.local.log_folders import KEEP, PREFIX, LogFolder


def _old_folders(root, count, start=1000.0):
    """`count` finished runs' folders (as an older version left them: no lock file), oldest first."""
    folders = []
    for index in range(count):
        folder = root / f"{PREFIX}old{index:02d}"
        folder.mkdir()
        (folder / "ffn-0.log").write_text("a log\n")
        os.utime(folder, (start + index, start + index))
        folders.append(folder)
    return folders


def test_a_new_run_keeps_the_newest_finished_folders_and_every_running_one(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = _old_folders(tmp_path, KEEP + 4)
    running = LogFolder(tmp_path)  # a run still going, made before the others finished: the oldest of all
    os.utime(running.path, (1.0, 1.0))
    with LocalProcesses() as processes:
        assert processes.workdir.parent == tmp_path
        left = set(tmp_path.glob(PREFIX + "*"))
        assert left == {*old[-KEEP:], running.path, processes.workdir}
    assert processes.workdir.exists()  # an orderly end keeps its logs for reading
    running.release()


def test_folders_of_other_users_are_left_alone(tmp_path, monkeypatch):
    old = _old_folders(tmp_path, KEEP + 2)
    real_stat = type(tmp_path).stat

    def stat(path, *args, **kwargs):
        result = real_stat(path, *args, **kwargs)
        if path == old[0]:  # someone else's folder
            return os.stat_result((result.st_mode, 0, 0, 0, os.getuid() + 1, 0, 0, 0, result.st_mtime, 0))
        return result

    monkeypatch.setattr(type(tmp_path), "stat", stat)
    mine = LogFolder(tmp_path)
    assert set(tmp_path.glob(PREFIX + "*")) == {old[0], *old[-KEEP:], mine.path}
    mine.release()


def test_a_released_folder_is_pruned_like_any_finished_one(tmp_path):
    first = LogFolder(tmp_path, keep=0)
    second = LogFolder(tmp_path, keep=0)  # the first still runs: kept
    assert first.path.exists() and second.path.exists()
    first.release()
    third = LogFolder(tmp_path, keep=0)
    assert not first.path.exists() and second.path.exists() and third.path.exists()
    second.release()
    third.release()
