"""Corpus for the embedded default model: the BSD-licensed English fortune cookie files.

Design: the corpus comes from Debian's `fortunes-min` and `fortunes` packages (fortune-mod 1.99.1, BSD licence,
"Copyright (c) 1991 The Regents of the University of California"), fetched with the
ordinary package client (`apt-get download`) and unpacked with `dpkg-deb -x`; nothing is
committed by hand. We keep only the files of the original BSD distribution (the offensive
set lives in another package, `fortunes-off`, which we never fetch) and leave out the
files added later by others (Debian hints, Perl, Linux, Tao, Pratchett quotes, ...),
ASCII art and the non-English file. Each fortune is one document; a seeded shuffle holds
5% of them out for evaluation.

Trade-off: 2.3 MB of quips, quotes and definitions is small (about half a million tokens),
so a few-million-parameter model trained on it for a quarter of an hour writes
English-looking text, not good text; in exchange it is freely redistributable, needs no
network beyond the package registry, and rebuilds in minutes on two CPU cores.

A share of the training fortunes is also wrapped in the chat template (a user asks about
the fortune's topic, the assistant answers with the fortune), so that chat requests get
an answer that ends with the end-of-sequence token.

Usage (prints statistics only; the training script imports these functions):
    python scripts/prepare_corpus.py [--workdir runs/default_model]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FORTUNES_PACKAGES = ("fortunes-min", "fortunes")  # -min holds fortunes, literature, riddles
FORTUNES_VERSION = "1:1.99.1-7.3"
FORTUNES_DIR = Path("usr/share/games/fortunes")
COPYRIGHT_FILE = Path("usr/share/doc/fortunes/copyright")

# Files of the original BSD fortune distribution, with the topic a chat prompt names.
# None: the file has no single topic (generic prompts only).
BSD_FILES: dict[str, str | None] = {
    "art": "art",
    "computers": "computers",
    "cookie": None,
    "definitions": None,
    "drugs": "drinking",
    "education": "school",
    "ethnic": "people",
    "food": "food",
    "fortunes": None,
    "goedel": None,
    "humorists": None,
    "kids": "children",
    "law": "the law",
    "linuxcookie": "computers",
    "literature": "books",
    "love": "love",
    "magic": "magic",
    "medicine": "medicine",
    "men-women": "love",
    "miscellaneous": None,
    "news": "the news",
    "people": "people",
    "pets": "pets",
    "platitudes": "life",
    "politics": "politics",
    "riddles": None,
    "science": "science",
    "songs-poems": "poetry",
    "sports": "sports",
    "startrek": "space",
    "wisdom": "wisdom",
    "work": "work",
    "zippy": None,
}

TOPIC_PROMPTS = (
    "Tell me something about {topic}.",
    "What do you think about {topic}?",
    "Say something about {topic}.",
    "Give me a quote about {topic}.",
    "Do you know a saying about {topic}?",
)
GENERIC_PROMPTS = (
    "Tell me my fortune.",
    "Say something wise.",
    "Tell me something interesting.",
    "Give me a quote.",
    "Hello!",
    "What is on your mind?",
    "Tell me a joke.",
    "Can you cheer me up?",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a fortune cookie.",
    "Answer briefly.",
)

HELDOUT_FRACTION = 0.05
CHAT_FRACTION = 0.3
SYSTEM_FRACTION = 0.2  # of chat views
MAX_CHARS = 1200  # longer fortunes are mostly stories that dwarf a 512-token context


@dataclass(frozen=True)
class Document:
    """One fortune: the file it came from and its cleaned text."""

    source: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """Train and held-out fortunes (disjoint), plus provenance for the model card."""

    train: tuple[Document, ...]
    heldout: tuple[Document, ...]
    deb_sha256: str
    deb_name: str
    copyright_text: str


# -- 1. fetch ------------------------------------------------------------------------------


def _download(package: str, workdir: Path) -> Path:
    """The .deb of `package` in workdir, downloaded with apt-get unless already there."""
    debs = sorted(workdir.glob(f"{package}_*.deb"))
    if debs:
        return debs[-1]
    for spec in (f"{package}={FORTUNES_VERSION}", package):
        done = subprocess.run(["apt-get", "download", spec], cwd=workdir, capture_output=True, text=True)
        if done.returncode == 0:
            if spec == package:
                logger.warning("%s %s not available; took the current version", package, FORTUNES_VERSION)
            break
        logger.warning("apt-get download %s failed: %s", spec, done.stderr.strip())
    debs = sorted(workdir.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(
            f"Could not download `{package}` with apt-get (run `apt-get update` first, or pass "
            "--fortunes-dir with an unpacked copy, e.g. /usr/share/games/fortunes)"
        )
    return debs[-1]


def fetch_fortunes(workdir: Path) -> tuple[Path, str, str]:
    """Download and unpack the fortune packages into workdir; returns (root, deb names, sha256s).

    Asks for the pinned version first so that a rebuild sees the same text; when the
    archive no longer carries it, takes the current one and says so.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    root = workdir / "fortunes_root"
    if root.exists():
        shutil.rmtree(root)
    names, shas = [], []
    for package in FORTUNES_PACKAGES:
        deb = _download(package, workdir)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        names.append(deb.name)
        shas.append(hashlib.sha256(deb.read_bytes()).hexdigest())
    return root, ", ".join(names), ", ".join(shas)


# -- 2. parse and clean --------------------------------------------------------------------

_OVERSTRIKE = re.compile(r".\x08")
_SPACES = re.compile(r"[ \t]+")


def clean_fortune(raw: str) -> str | None:
    """Normalized text of one fortune, or None when it is not prose worth learning from."""
    text = raw
    while "\x08" in text:  # "_\bA" (underline) and "A\bA" (bold) both leave "A"
        text = _OVERSTRIKE.sub("", text, count=0)
        text = text.replace("\x08", "")
    lines = [_SPACES.sub(" ", line).strip() for line in text.splitlines()]
    text = "\n".join(lines).strip()
    text = re.sub(r"\n{3,}", "\n\n", text)
    if not text or len(text) > MAX_CHARS:
        return None
    if any(ord(c) > 126 or (ord(c) < 32 and c != "\n") for c in text):
        return None
    letters = sum(c.isalpha() for c in text)
    if letters < 10 or letters / len(text) < 0.6:  # tables, ASCII pictures, code
        return None
    return text


def parse_fortune_file(path: Path) -> list[str]:
    """Raw fortunes of one strfile source file (entries separated by lines holding `%`)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return [part for part in re.split(r"^%$", text, flags=re.MULTILINE) if part.strip()]


def load_documents(fortunes_dir: Path) -> list[Document]:
    """Cleaned, de-duplicated documents of the BSD files, in a fixed order."""
    missing = [name for name in BSD_FILES if not (fortunes_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fortune files missing in `{fortunes_dir}`: {', '.join(missing)}. "
            f"Expected the files of Debian's {' and '.join(FORTUNES_PACKAGES)} packages."
        )
    seen: set[str] = set()
    docs: list[Document] = []
    for name in BSD_FILES:
        for raw in parse_fortune_file(fortunes_dir / name):
            text = clean_fortune(raw)
            if text is None or text in seen:
                continue
            seen.add(text)
            docs.append(Document(source=name, text=text))
    return docs


def split_documents(
    docs: list[Document], seed: int, heldout_fraction: float = HELDOUT_FRACTION
) -> tuple[tuple[Document, ...], tuple[Document, ...]]:
    """Seeded shuffle, then the first `heldout_fraction` of fortunes are held out."""
    order = list(docs)
    random.Random(seed).shuffle(order)
    n_heldout = max(1, int(len(order) * heldout_fraction))
    return tuple(order[n_heldout:]), tuple(order[:n_heldout])


def build_corpus(workdir: Path, seed: int, fortunes_dir: Path | None = None) -> Corpus:
    """Fetch (unless fortunes_dir is given), clean and split the corpus."""
    if fortunes_dir is None:
        root, deb_name, sha = fetch_fortunes(workdir)
        fortunes_dir = root / FORTUNES_DIR
        copyright_text = (root / COPYRIGHT_FILE).read_text(encoding="utf-8", errors="replace")
    else:
        deb_name, sha = "(local directory)", ""
        copyright_path = Path("/") / COPYRIGHT_FILE
        copyright_text = copyright_path.read_text() if copyright_path.is_file() else ""
    docs = load_documents(fortunes_dir)
    train, heldout = split_documents(docs, seed)
    logger.info("corpus: %d fortunes (%d train, %d held out)", len(docs), len(train), len(heldout))
    return Corpus(train, heldout, sha, deb_name, copyright_text)


# -- 3. training views ---------------------------------------------------------------------


def riddle_turn(text: str) -> tuple[str, str] | None:
    """(question, answer) of a `Q: ... A: ...` fortune, else None."""
    match = re.fullmatch(r"Q:\s*(.+?)\s*\nA:\s*(.+)", text, flags=re.DOTALL)
    if not match:
        return None
    return match.group(1).strip(), match.group(2).strip()


def chat_messages(doc: Document, rng: random.Random) -> list[dict[str, str]]:
    """Chat messages that teach the chat format on this fortune: a (sometimes system-
    prompted) user turn asking about its topic, answered by the fortune."""
    riddle = riddle_turn(doc.text)
    if riddle is not None:
        prompt, answer = riddle
    else:
        topic = BSD_FILES.get(doc.source)
        if topic is not None and rng.random() < 0.7:
            prompt = rng.choice(TOPIC_PROMPTS).format(topic=topic)
        else:
            prompt = rng.choice(GENERIC_PROMPTS)
        answer = doc.text
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    if rng.random() < SYSTEM_FRACTION:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return messages


def training_views(
    docs: Iterable[Document], seed: int, chat_fraction: float = CHAT_FRACTION
) -> list[str | list[dict[str, str]]]:
    """Each train fortune as plain text, or (for `chat_fraction` of them and every riddle)
    as chat messages."""
    rng = random.Random(seed + 1)
    views: list[str | list[dict[str, str]]] = []
    for doc in docs:
        if rng.random() < chat_fraction or riddle_turn(doc.text) is not None:
            views.append(chat_messages(doc, rng))
        else:
            views.append(doc.text)
    return views


_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*")


def words(text: str) -> list[str]:
    """Lower-case words (letters with inner apostrophes) of a text."""
    return _WORD.findall(text.lower())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/default_model"))
    parser.add_argument("--fortunes-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    corpus = build_corpus(args.workdir, args.seed, args.fortunes_dir)
    chars = sum(len(d.text) for d in corpus.train)
    vocab = {w for d in corpus.train for w in words(d.text)}
    print(f"package: {corpus.deb_name} sha256={corpus.deb_sha256}")
    print(f"train: {len(corpus.train)} fortunes, {chars} chars, {len(vocab)} distinct words")
    print(f"held out: {len(corpus.heldout)} fortunes")
    for doc in corpus.train[:3]:
        print(f"--- [{doc.source}]\n{doc.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
