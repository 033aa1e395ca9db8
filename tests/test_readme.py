"""The README's commands: the Python snippet runs as written on a CPU, and every `kvcal` line parses."""

import os
import re
import shlex
import subprocess
import sys

import click
import pytest
import typer

from tests.conftest import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.slow
def test_the_python_snippet_runs_as_written(tmp_path, smollm2):
    """In a folder holding the artifact the quickstart writes (here with random KVQuant tables of its shapes: the
    snippet is about the API), the README's Python block runs with no warning and prints the greedy continuation that
    kvcal's own decoding loop gives through the same cache."""
    from kvcal.accounting import bits_per_element
    from kvcal.artifact import Artifact, make_header, save_artifact
    from kvcal.generate import generate_text
    from kvcal.recipes import resolve

    (snippet,) = blocks("python")
    method, _, _ = resolve(None, "kvquant-nuq4-1pct", None)
    path = tmp_path / "artifacts" / "smollm2-135m" / "kvquant-nuq4-1pct.safetensors"
    path.parent.mkdir(parents=True)
    header = make_header(method, smollm2, None, bits_per_element(method, smollm2.dims))
    save_artifact(path, Artifact(header, method.synthetic_tensors(smollm2.dims)))
    result = subprocess.run([sys.executable, "-W", "error::FutureWarning", "-c", snippet], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    tokens = int(re.search(r"max_new_tokens=(\d+)", snippet).group(1))
    prompt = re.search(r'tokenizer\("([^"]+)"', snippet).group(1)
    expected = generate_text(prompt, "smollm2-135m", path, None, None, tokens, "float32", "cpu")["text"]
    assert result.stdout.strip() == expected.strip() and expected.strip()


def test_every_kvcal_line_of_the_readme_parses():
    """Each `kvcal ...` line of the README's shell blocks names a command and options that exist (parsed by the CLI,
    not run)."""
    from kvcal.cli import app

    root = typer.main.get_command(app)
    lines = [line for block in blocks("bash") for line in block.splitlines() if line.startswith("kvcal ")]
    assert len(lines) > 15
    for line in lines:
        args = shlex.split(line, comments=True)[1:]
        command, path = root, ["kvcal"]
        while isinstance(command, click.Group):
            name = args.pop(0)
            command = command.get_command(click.Context(command), name)
            assert command is not None, line
            path.append(name)
        command.make_context(" ".join(path), args)  # raises click's usage error on an unknown option or bad value
