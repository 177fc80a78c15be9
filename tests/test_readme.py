"""The README is pasted by newcomers: its commands must parse and run as written, and it must lead
to every docs page and every command."""

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.launch.cli import build_parser, parse_args

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _bash_blocks(text: str) -> dict[str, str]:
    """Every ```bash block, keyed by the heading of the section it is in."""
    blocks, heading = {}, ""
    for part in re.split(r"(?m)^(## .*)$", text):
        if part.startswith("## "):
            heading = part[3:].strip()
            continue
        for i, block in enumerate(re.findall(r"```bash\n(.*?)```", part, re.S)):
            blocks[heading if i == 0 else f"{heading} #{i + 1}"] = block
    return blocks


def _asyncrl_commands(text: str):
    """The `asyncrl ...` commands of the bash blocks, comments, redirections and `&` dropped."""
    for block in _bash_blocks(text).values():
        for line in block.replace("\\\n", " ").splitlines():
            if line.lstrip().startswith("#"):
                continue
            for command in re.split(r"&&|(?<![>&])&(?!\S)", line.split(" #")[0]):
                argv = shlex.split(command.strip())
                redirect = next((i for i, a in enumerate(argv) if re.match(r"^\d?>", a)), len(argv))
                if argv and argv[0] in ("asyncrl", ".venv/bin/asyncrl"):
                    yield argv[1:redirect]


def test_every_readme_asyncrl_command_parses():
    docs = README + "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    variables = dict(re.findall(r'^(\w+)="(.*)"$', docs, re.M))  # shell variables a block sets
    docs = re.sub(r"\$(\w+)", lambda v: variables.get(v.group(1), v.group(0)), docs)
    commands = list(_asyncrl_commands(docs))
    assert len(commands) > 25
    for argv in commands:
        try:
            parse_args(argv)
        except SystemExit as e:  # --help / --version exit 0; a wrong option exits 2
            assert e.code == 0, f"`asyncrl {' '.join(argv)}` does not parse"


def test_readme_links_every_docs_page_and_names_every_command():
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{page.name}" in README, f"README does not link docs/{page.name}"
    for command in ("asyncrl data", "asyncrl simulate", "asyncrl model from-gguf", "asyncrl configs",
                    "asyncrl --version"):
        assert command in README, command
    assert "source .venv/bin/activate" in README


def test_every_cli_option_has_help_and_the_top_level_help_has_examples():
    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, __import__("argparse")._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{path} {name}")
            elif action.dest not in ("help", "version"):
                yield path, action

    missing = [f"{path} {action.option_strings or action.dest}" for path, action in walk(build_parser(), "asyncrl")
               if not action.help]
    assert not missing, missing
    text = build_parser().format_help()
    assert "examples:" in text and "asyncrl run smollm2_arith" in text and "docs/" in text


def test_version():
    from asyncrl import __version__

    r = subprocess.run([sys.executable, "-m", "asyncrl", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"asyncrl {__version__}"


def test_configs_folder_copies_whole():
    # `cp -r configs mine` must give working files: no links in configs/ (the package's asyncrl/configs
    # is the link, to configs/).
    files = sorted((REPO / "configs").iterdir())
    assert files and not [p for p in files if p.is_symlink()]
    assert (REPO / "asyncrl" / "configs").resolve() == (REPO / "configs").resolve()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_running_the_roles_separately_pastes_and_runs(tmp_path):
    """The README's block, run by bash from the checkout as written; only its Redis port and its
    scratch folder are moved so that the test shares nothing with the machine."""
    block = _bash_blocks(README)["Running the roles separately"]
    port = _free_port()
    script = block.replace("6379", str(port)).replace("/tmp/asyncrl-split", str(tmp_path / "split"))
    assert script != block
    proc = subprocess.Popen(["bash", "-e", "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True, timeout=30)
    logs = {p.name: p.read_text()[-2000:] for p in (tmp_path / "split").glob("*.log")}
    assert proc.returncode == 0, (out[-4000:], logs)
    steps = [line for line in out.splitlines() if line.startswith("step=")]
    assert len(steps) == 10, out[-4000:]
    with socket.socket() as s:  # the script shut its redis-server down
        assert s.connect_ex(("127.0.0.1", port)) != 0
    # Both generators took part in the learner's weight group.
    assert any("members=" in line and "'g0.0'" in line and "'g1.0'" in line for line in out.splitlines()), out[-4000:]
