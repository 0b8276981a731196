"""BM25 retrieval over a corpus of passages, built once per corpus (the search environment's retriever,
docs/environments.md, "Search").

Scoring is bm25s's Lucene variant, k1 = 1.5, b = 0.75: a passage's score for a query is the sum over the query's
distinct known terms t of idf(t) · tf / (tf + k1 · (1 − b + b · |d| / avgdl)), idf(t) = ln(1 + (N − df + 0.5) /
(df + 0.5)), where |d| counts the passage's tokens after stop words are removed. A passage is indexed as its
title and text (Search-R1's `contents`: `"Title"\\ntext`). Tokenisation: lowercase, tokens are runs of two or more
word characters (bm25s's `(?u)\\b\\w\\w+\\b`), no stemming, bm25s's 33 English stop words removed ("a", "an",
"and", "the", "of", "in", "was", ...). A query's terms that no passage holds are ignored. The top k passages with
a positive score are returned, ties in corpus order.

The index is cached on disk in the user's cache (`pipeline.envs.base.user_cache`, `search-index/<sha256>/`) by
the corpus's SHA-256, written atomically, and kept in memory per process: every stage and episode of every run on
that corpus reads the same index, built by the first that needs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import numpy as np

K1, B = 1.5, 0.75


def _tokenize(texts: list[str], ids: bool):
    import bm25s  # start-up cost: bm25s

    return bm25s.tokenize(texts, lower=True, stopwords="en", return_ids=ids, show_progress=False)


def corpus_hash(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()


class Retriever:
    """BM25 over `texts` (one passage each); `search` returns row numbers into `texts`."""

    def __init__(self, texts: list[str], index=None):
        import bm25s  # start-up cost: bm25s

        self.size = len(texts)
        if index is None:
            index = bm25s.BM25(k1=K1, b=B, method="lucene")
            index.index(_tokenize(texts, ids=True), show_progress=False)
        self.index = index
        self._memo: dict[tuple[str, int], tuple[int, ...]] = {}

    @classmethod
    def cached(cls, texts: list[str], cache_dir: Path) -> Retriever:
        """The index of `texts` from `cache_dir/search-index/<sha256>/`, built and saved there when absent."""
        return _cached(tuple(texts), str(cache_dir))

    def scores(self, query: str) -> np.ndarray:
        known = [t for t in _tokenize([query], ids=False)[0] if t in self.index.vocab_dict]
        if not known:
            return np.zeros(self.size, dtype=np.float32)
        return self.index.get_scores(list(dict.fromkeys(known)))

    def search(self, query: str, k: int) -> tuple[int, ...]:
        """The rows of the top `k` passages for `query` with a positive score, best first, ties in corpus order."""
        key = (query, k)
        if key not in self._memo:
            s = self.scores(query)
            rows = np.flatnonzero(s > 0)                 # few passages hold a query's terms: select among them
            if k < len(rows):
                kth = np.partition(s[rows], len(rows) - k)[len(rows) - k]
                rows = rows[s[rows] >= kth]              # the top k and whatever ties the k-th
            rows = rows[np.lexsort((rows, -s[rows]))][:k]
            self._memo[key] = tuple(int(r) for r in rows)
        return self._memo[key]


@lru_cache(maxsize=4)
def _cached(texts: tuple[str, ...], cache_dir: str) -> Retriever:
    import bm25s  # start-up cost: bm25s

    folder = Path(cache_dir) / "search-index" / corpus_hash(list(texts))
    if (folder / "done.json").is_file():
        return Retriever(list(texts), bm25s.BM25.load(str(folder), show_progress=False))
    r = Retriever(list(texts))
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".building-"))
    try:
        r.index.save(str(tmp), show_progress=False)
        (tmp / "done.json").write_text(json.dumps({"passages": len(texts)}))
        os.replace(tmp, folder)                        # another process may have won: then keep its index
    except OSError:
        if not (folder / "done.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return r
