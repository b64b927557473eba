"""Search backends for ``WebSearch``: a protocol plus the default offline one, BM25 over local Markdown files.

The default index covers the project's own README and docs/*.md, so an offline agent can answer questions about
OpenTinker. A real web backend (an HTTP search API) only has to implement ``SearchBackend.search``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

_WORD = re.compile(r"[a-z0-9_]+")
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SearchHit:
    """One result: where it came from, a snippet, and its relevance score."""

    title: str
    source: str
    snippet: str
    score: float


@runtime_checkable
class SearchBackend(Protocol):
    """Anything that turns a query into ranked hits."""

    def search(self, query: str, k: int) -> list[SearchHit]: ...


def project_documents() -> list[Path]:
    """README.md and docs/*.md of the project checkout (empty when installed without them)."""
    files = [_PROJECT_ROOT / "README.md", *sorted((_PROJECT_ROOT / "docs").glob("*.md"))]
    return [f for f in files if f.is_file()]


@dataclass(frozen=True)
class _Chunk:
    title: str
    source: str
    text: str
    terms: Counter
    length: int


class LocalDocsBackend:
    """BM25 over Markdown sections (split at headings), built once at construction."""

    def __init__(self, paths: Sequence[str | Path] | None = None, k1: float = 1.5, b: float = 0.75):
        files = [Path(p) for p in paths] if paths is not None else project_documents()
        missing = [str(p) for p in files if not Path(p).is_file()]
        if missing:
            raise FileNotFoundError(f"paths: expected existing files, missing {missing}")
        self.k1, self.b = k1, b
        self.chunks = [chunk for f in files for chunk in _split_markdown(f)]
        self.avg_length = sum(c.length for c in self.chunks) / max(len(self.chunks), 1)
        doc_freq = Counter(term for c in self.chunks for term in c.terms)
        n = len(self.chunks)
        self.idf = {t: math.log(1 + (n - df + 0.5) / (df + 0.5)) for t, df in doc_freq.items()}

    def search(self, query: str, k: int = 3) -> list[SearchHit]:
        terms = _WORD.findall(query.lower())
        scored = []
        for chunk in self.chunks:
            score = 0.0
            for term in terms:
                tf = chunk.terms.get(term, 0)
                if tf:
                    norm = self.k1 * (1 - self.b + self.b * chunk.length / self.avg_length)
                    score += self.idf[term] * tf * (self.k1 + 1) / (tf + norm)
            if score > 0:
                scored.append((score, chunk))
        scored.sort(key=lambda pair: -pair[0])
        return [SearchHit(c.title, c.source, _snippet(c.text, terms), round(s, 3)) for s, c in scored[:k]]


def _split_markdown(path: Path) -> list[_Chunk]:
    chunks, title, lines = [], path.stem, []

    def flush():
        text = "\n".join(lines).strip()
        if text:
            words = _WORD.findall(f"{title} {text}".lower())
            chunks.append(_Chunk(title, path.name, text, Counter(words), len(words)))

    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("#"):
            flush()
            title, lines = line.lstrip("#").strip() or path.stem, []
        else:
            lines.append(line)
    flush()
    return chunks


def _snippet(text: str, terms: list[str], width: int = 300) -> str:
    """The window of ``text`` around the first query term, whitespace collapsed."""
    flat = " ".join(text.split())
    lower = flat.lower()
    positions = [lower.find(t) for t in terms if lower.find(t) >= 0]
    start = max(min(positions) - width // 3, 0) if positions else 0
    return ("…" if start else "") + flat[start : start + width] + ("…" if start + width < len(flat) else "")
