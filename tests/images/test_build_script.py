"""`make images` (scripts/build_images.py) installs the tools it needs as .ci/run does, where it can (issue 35
item 10). No tool runs: apt-get, podman and the builds are stand-ins that record what they were asked."""

import pytest

from imagekit import build_images


class Machine:
    """Which tools are on PATH, who we are, and every command run; apt-get install puts its packages' tools there."""

    def __init__(self, monkeypatch, installed, root=True, apt=True):
        self.installed, self.commands = set(installed) | ({"apt-get"} if apt else set()), []
        monkeypatch.chdir(build_images.ROOT)  # main() moves there; put back afterwards
        monkeypatch.setattr(build_images.shutil, "which", lambda tool: f"/usr/bin/{tool}" if tool in self.installed else None)
        monkeypatch.setattr(build_images.os, "geteuid", lambda: 0 if root else 1000)
        monkeypatch.setattr(build_images.subprocess, "run", self.run)
        monkeypatch.setattr(build_images, "ensure_base", lambda force=False: build_images.BASE_TAG)
        monkeypatch.setattr(build_images, "build", lambda name, network=None: self.commands.append(["build", name]) or name)

    def run(self, argv, check=False, env=None, **kwargs):
        self.commands.append(list(argv))
        if argv[:2] == ["apt-get", "install"]:
            assert env["DEBIAN_FRONTEND"] == "noninteractive"
            self.installed |= {tool for tool, packages in build_images.TOOL_PACKAGES.items() if set(packages) <= set(argv)}


def test_missing_tools_are_installed_with_apt_get_as_root_then_the_images_built(monkeypatch):
    machine = Machine(monkeypatch, installed={"runc"})
    assert build_images.main(["all"]) == 0
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends"]
    assert machine.commands == [["apt-get", "update", "-q"],
                                [*install, "podman", "catatonit", "uidmap", "fuse-overlayfs", "mmdebstrap"],
                                ["build", "operator"], ["build", "runtime"]]


@pytest.mark.parametrize("root, apt, flags", [(False, True, []), (True, False, []), (True, True, ["--no-install"])])
def test_without_root_or_apt_get_it_stops_with_the_command_to_run(root, apt, flags, monkeypatch, capsys):
    machine = Machine(monkeypatch, installed={"runc"}, root=root, apt=apt)
    assert build_images.main(["all", *flags]) == 2
    assert machine.commands == []
    error = capsys.readouterr().err
    assert error.startswith("missing: podman, mmdebstrap (install them, ") and \
        "apt-get install -y -q --no-install-recommends podman catatonit uidmap fuse-overlayfs mmdebstrap" in error


def test_a_failed_install_says_which_command_failed(monkeypatch, capsys):
    machine = Machine(monkeypatch, installed={"podman", "runc"})

    def failing(argv, check=False, env=None, **kwargs):
        machine.commands.append(argv)
        if argv[1] == "install":
            raise build_images.subprocess.CalledProcessError(100, argv)

    monkeypatch.setattr(build_images.subprocess, "run", failing)
    assert build_images.main(["all"]) == 2
    assert "installing the tools failed: `apt-get install -y -q --no-install-recommends mmdebstrap` exited 100" \
        in capsys.readouterr().err
