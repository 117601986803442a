"""Which strategy methods, attributes and keywords OpenRLHF's trainers, CLIs and Ray actors use, release by release,
and whether get_strategy.py has each. Read from the releases' own wheels, so it cannot go stale.

    .venv/bin/python compat/openrlhf/audit.py            # every flat release, 0.8.5 to 0.10.1; a Markdown table
    .venv/bin/python compat/openrlhf/audit.py 0.10.1     # one release

Each wheel is fetched with `pip download --no-deps` into compat/openrlhf/.wheels (about 150 kB each). Every
`<something>.strategy.NAME` and `strategy.NAME` in the release's Python files, outside OpenRLHF's own strategy
package (openrlhf/utils/deepspeed/), is a use: NAME must be an attribute of a strategy built by get_strategy(), and
each keyword a call passes must be one the method takes. Exits 1 if any use is unhandled.
"""

import argparse
import ast
import inspect
import os
import subprocess
import sys
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # the repository root, for get_strategy.py
RELEASES = ["0.8.5", *(f"0.9.{n}" for n in range(11)), "0.10.0", "0.10.1"]
OWN_STRATEGY = "openrlhf/utils/deepspeed/"  # OpenRLHF's strategy itself: what get_strategy.py replaces


def wheel(release: str) -> str:
    folder = os.path.join(HERE, ".wheels")
    found = [n for n in os.listdir(folder) if n.startswith(f"openrlhf-{release}-")] if os.path.isdir(folder) else []
    if not found:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"openrlhf=={release}", "-d", folder]
        subprocess.run(pip, check=True)
        found = [n for n in os.listdir(folder) if n.startswith(f"openrlhf-{release}-")]
    return os.path.join(folder, found[0])


def is_strategy(node) -> bool:
    """`strategy` or `<anything>.strategy`."""
    return (isinstance(node, ast.Name) and node.id == "strategy") or (
        isinstance(node, ast.Attribute) and node.attr == "strategy"
    )


def uses(release: str) -> dict:
    """{name: {"files": {file, ...}, "keywords": {keyword, ...}}} of one release."""
    found = {}
    with zipfile.ZipFile(wheel(release)) as archive:
        for path in archive.namelist():
            where = path.split("purelib/")[-1]
            if not where.startswith("openrlhf/") or not where.endswith(".py") or where.startswith(OWN_STRATEGY):
                continue
            tree = ast.parse(archive.read(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and is_strategy(node.value):
                    found.setdefault(node.attr, {"files": set(), "keywords": set()})["files"].add(where)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_strategy(node.func.value):
                    keywords = {k.arg for k in node.keywords if k.arg is not None}
                    found.setdefault(node.func.attr, {"files": set(), "keywords": set()})["keywords"] |= keywords
    return found


def gaps(found: dict, strategy) -> dict:
    """{name: what is missing} for the uses get_strategy.py does not handle."""
    missing = {}
    for name, use in sorted(found.items()):
        if not hasattr(strategy, name):
            missing[name] = "no such attribute"
            continue
        member = getattr(strategy, name)
        if use["keywords"] and callable(member):
            parameters = inspect.signature(member).parameters
            if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
                unknown = sorted(use["keywords"] - set(parameters))
                if unknown:
                    missing[name] = f"no keyword {', '.join(unknown)}"
    return missing


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("releases", nargs="*", default=RELEASES)
    releases = parser.parse_args().releases
    from get_strategy import get_strategy

    strategy = get_strategy(argparse.Namespace(zero_stage=2))  # no process group: the attributes alone
    print("| release | names used | keywords used | unhandled |")
    print("| --- | --- | --- | --- |")
    failed = False
    for release in releases:
        found = uses(release)
        missing = gaps(found, strategy)
        failed |= bool(missing)
        keywords = sum(len(use["keywords"]) for use in found.values())
        shown = "; ".join(f"`{name}`: {why}" for name, why in missing.items()) or "none"
        print(f"| {release} | {len(found)} | {keywords} | {shown} |")
    names = sorted(set().union(*(uses(release) for release in releases)))
    print(f"\nEvery name used by any of them ({len(names)}): " + ", ".join(f"`{n}`" for n in names))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
