"""The README is a front door and docs/ holds the rest: the README stays short, every page is
reachable from it, every relative link and anchor resolves, the commands it shows name flags that
exist, and its shell examples work against a live server (the slow test)."""

import json
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
CODE_FOLDERS = ("engine", "router", "launcher", "scripts", "tests")
MAX_README_LINES = 250

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
NARRATIVE = re.compile(r"\bsessions?\b|\bissues? #?\d+", re.IGNORECASE)
# Written in two parts so that this file does not match its own search.
MISSING_NOTES = "DESIGN" + ".md"
ARCHITECTURE_CITE = re.compile(r"docs/architecture\.md#([a-z0-9_-]+)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced code block, fences matched in order."""
    blocks, info, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, body = line[3:].strip(), []
            else:
                blocks.append((info, "\n".join(body) + "\n"))
                info = None
        elif info is not None:
            body.append(line)
    return blocks


def without_code_blocks(text: str) -> str:
    kept, inside = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


def prose(text: str) -> str:
    """Markdown without its code: brackets inside code are not links."""
    return INLINE_CODE.sub("", without_code_blocks(text))


def relative_links(page: Path) -> list[str]:
    targets = LINK.findall(prose(page.read_text()))
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in without_code_blocks(page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def broken_link(page: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
        return f"{page.name}: {target}: no such file"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{page.name}: {target}: no heading with that anchor"
    return None


def test_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail to docs/"


LAYOUT_ROW = re.compile(r"^\| `((?:engine|router|launcher)/[\w/]*)` \|", re.MULTILINE)


def package_folders() -> set[str]:
    top = ("engine", "router", "launcher")
    return {
        f"{init.parent.relative_to(REPO).as_posix()}/"
        for t in top
        for init in (REPO / t).rglob("__init__.py")
    }


def test_the_layout_table_lists_every_package_folder_and_no_other():
    """docs/architecture.md's table is the one description of the layout, so it cannot go stale."""
    rows = LAYOUT_ROW.findall((DOCS / "architecture.md").read_text())
    assert len(rows) == len(set(rows)), "a folder has two rows"
    assert set(rows) == package_folders(), (
        f"missing: {sorted(package_folders() - set(rows))}; not folders: {sorted(set(rows) - package_folders())}"
    )


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    docs = set(DOCS.glob("*.md"))
    assert docs, "docs/ has no pages"
    assert not {p.resolve() for p in docs} - linked, "docs pages the README does not link to"
    in_docs = {p for p in linked if p.parent == DOCS.resolve()}
    assert all(p.exists() for p in in_docs), f"README links to missing pages: {in_docs}"


def test_every_relative_link_and_anchor_resolves():
    broken = [b for page in pages() for t in relative_links(page) if (b := broken_link(page, t))]
    assert not broken, "\n".join(broken)


def test_no_narrative_of_how_the_work_went():
    hits = [
        f"{p.name}:{n}: {line.strip()}"
        for p in pages()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if NARRATIVE.search(line)
    ]
    assert not hits, "\n".join(hits)


def code_files():
    for folder in CODE_FOLDERS:
        yield from (p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".sh", ".pyi"))


def test_code_cites_docs_that_exist():
    missing = [str(p.relative_to(REPO)) for p in code_files() if MISSING_NOTES in p.read_text()]
    assert not missing, (
        f"{MISSING_NOTES} is not in the repository; cite docs/architecture.md: {missing}"
    )
    architecture = DOCS / "architecture.md"
    unknown = [
        f"{p.relative_to(REPO)}: #{anchor}"
        for p in code_files()
        for anchor in ARCHITECTURE_CITE.findall(p.read_text())
        if anchor not in anchors(architecture)
    ]
    assert not unknown, f"citations of docs/architecture.md sections that do not exist: {unknown}"


# --- the commands the README and docs show ---------------------------------------------------


def shell_lines(page: Path) -> list[str]:
    """The command lines of a page's shell blocks (```sh, ```bash, and `$ ` lines of plain blocks),
    continuation lines joined."""
    lines = []
    for kind, block in code_blocks(page.read_text()):
        if kind not in ("sh", "bash", ""):
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not kind and not line.startswith("$ "):
                continue  # a plain block shows output; only its prompted lines are commands
            line = line.removeprefix("$ ")
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def our_command(words: list[str]) -> tuple[list[str], list[str]] | None:
    """(the help command of the program a command line runs, the words its flags are in), or None
    for a line that runs something else."""
    for i, word in enumerate(words):
        if word.endswith("bucketserve") and "/" in word or word == "bucketserve":
            return helper_for(["launcher"], words[i + 1 :])
        if word.startswith("bucketserve:"):  # docker run IMAGE ARGS: the image runs the launcher
            return ["-m", "launcher", "--help"], words[i + 1 :]
        if word == "-m" and i + 1 < len(words) and words[i + 1] in ("launcher", "engine", "router"):
            return helper_for([words[i + 1]], words[i + 2 :])
    return None


def helper_for(module: list[str], rest: list[str]) -> tuple[list[str], list[str]]:
    subcommands = {
        "launcher": ("generate", "bench", "serve", "buckets", "warmup-profile", "loadtest"),
        "engine": ("serve", "buckets", "warmup-profile"),
    }.get(module[0], ())
    if rest and rest[0] in subcommands:
        return ["-m", *module, rest[0], "--help"], rest[1:]
    return ["-m", *module, "--help"], rest


@cache
def help_text(command: tuple[str, ...]) -> str:
    done = subprocess.run(
        [sys.executable, *command],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"{' '.join(command)} failed: {done.stderr[-2000:]}"
    return done.stdout


def test_shown_commands_name_flags_that_exist():
    checked, unknown = 0, []
    for page in pages():
        for line in shell_lines(page):
            found = our_command(shlex.split(line, comments=True))
            if found is None:
                continue
            command, words = found
            known = set(re.findall(r"--[a-z][a-z0-9-]*", help_text(tuple(command))))
            flags = [w.split("=")[0] for w in words if w.startswith("--")]
            checked += 1
            unknown += [f"{page.name}: {flag} in `{line}`" for flag in flags if flag not in known]
    assert checked >= 5, (
        "the pages show fewer commands than expected: is the code-block parser broken?"
    )
    assert not unknown, "flags the commands do not have:\n" + "\n".join(unknown)


def test_the_multi_shard_example_splits_the_embedded_model(smollm_dir):
    from launcher.checks import split_problem

    line = next(line for line in shell_lines(README) if "--num-shard" in line)
    shards = int(re.search(r"--num-shard (\d+)", line).group(1))
    if "--model-id" in line:
        pytest.skip("the example serves a model of its own")
    config = json.loads((Path(smollm_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    assert split_problem(heads, config.get("num_key_value_heads", heads), shards) is None


# --- the README's examples against a live server ---------------------------------------------


def readme_curl_lines() -> list[str]:
    return [line for line in shell_lines(README) if line.startswith("curl ")]


def readme_python_example() -> str:
    return next(
        b for kind, b in code_blocks(README.read_text()) if kind == "python" and "OpenAI(" in b
    )


def readme_generate_example() -> tuple[str, list[dict]]:
    block = next(b for _, b in code_blocks(README.read_text()) if "bucketserve generate" in b)
    command, *shown = block.strip().splitlines()
    return command.removeprefix("$ "), [json.loads(line) for line in shown]


def test_the_readme_examples_are_found():
    assert len(readme_curl_lines()) >= 2
    assert "localhost:8080" in readme_python_example()
    command, shown = readme_generate_example()
    assert "--json" in command and len(shown) == command.count("--prompt ")


@pytest.mark.slow
def test_the_readme_examples_run_against_a_live_server(smollm_dir, tmp_path):
    from tests.test_launcher import Launch
    from tests.test_launcher_router import wait_served
    from tests.test_server import short_socket_dir

    folder = short_socket_dir()
    launch = Launch(
        smollm_dir,
        "--device",
        "cpu",
        "--single-process",  # as `make run` serves
        "--hostname",
        "127.0.0.1",
        "--uds-path",
        f"{folder}/s",
        # The OpenAI example sets no max_tokens: a reply may run to the context's end, so the
        # context is kept short.
        "--max-input-tokens",
        "64",
        "--max-total-tokens",
        "96",
        "--max-batch-prefill-tokens",
        "128",
        folder=folder,
    )
    try:
        url = wait_served(launch)
        for line in readme_curl_lines():
            done = subprocess.run(
                ["bash", "-c", line.replace("localhost:8080", url.removeprefix("http://"))],
                check=False,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, f"{line}: {done.stderr}"
            answer = json.loads(done.stdout)
            assert answer.get("generated_text") or answer["choices"][0]["message"]["content"], line
        printed = run_python(
            readme_python_example().replace("http://localhost:8080", url), tmp_path
        )
        assert printed.strip(), "the OpenAI example printed nothing"
    finally:
        launch.clean_up()


def run_python(source: str, folder: Path) -> str:
    script = folder / "example.py"
    script.write_text(source)
    done = subprocess.run(
        [sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_readme_generate_example_prints_what_it_shows():
    command, shown = readme_generate_example()
    words = shlex.split(command)
    assert words[0].endswith("bucketserve")
    done = subprocess.run(
        [sys.executable, "-m", "launcher", *words[1:]],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [p["prompt"] for p in printed] == [s["prompt"] for s in shown]
    assert all(set(p) == set(s) and p["text"] for p, s in zip(printed, shown))


def test_the_metrics_page_lists_every_request_outcome():
    from router.http.metrics import OUTCOMES

    api = (DOCS / "api.md").read_text()
    assert [o for o in OUTCOMES if f"`{o}`" not in api] == []


def test_the_dtype_line_shown_is_the_one_the_cpu_adapter_writes(monkeypatch):
    """The example start-up line in docs/models.md is the adapter's own wording for a CPU with
    AVX512-BF16 and no AMX (this machine's kind); AMX appears only where torch reports it."""
    import torch

    from engine.devices.cpu.adapter import CPUAdapter

    monkeypatch.delenv("BUCKETSERVE_CPU_ISA", raising=False)  # the CPU's own choice
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    dtype, why = CPUAdapter.auto_dtype(CPUAdapter.__new__(CPUAdapter))
    shown = re.search(r"^dtype auto: (.*)$", (DOCS / "models.md").read_text(), re.M).group(1)
    assert shown == f"{str(dtype).removeprefix('torch.')} ({why})"
