"""Suffix-tree drafts (SuffixDecoding's design): a request's own prompt and output, and the worker's
recent responses, each as a tree of the counts of every substring up to `max_depth` tokens.

Design: a tree holds, for every start position of each sequence it indexes, the path of the next up
to `max_depth` tokens, each node counting the occurrences of the substring from the root to it
(an occurrence at a sequence's end counts too, so a continuation seen once out of two is worth
1/2). A draft matches the last `m` tokens of the request's context from the root, for every `m`
from 1 up while it still matches, and follows the most frequent child from there: each token's
estimated probability is the product of `child / parent` counts along the path, drafting stops
below `min_token_prob` or after `max_spec_factor * m + max_spec_offset` tokens (a short match
guesses little), and the draft with the highest score (the sum of its probabilities; the longer
match on a tie) wins. Two trees are asked: the request's own (prompt + output, dropped when it
leaves the running set) and a global one over the outputs of the last `max_cached_requests`
requests (at most `max_cached_tokens` tokens, evicted oldest first), the better score winning;
the global tree is what makes an agent loop's repeated tool calls and answers draftable across
requests. Memory is bounded by `max_depth` nodes per token held. The trees are fed only when a
request drafts (catching up then), so a saturated worker that does not speculate pays nothing for
them, and the outputs it wrote meanwhile are not learned. Trade-off: a plain Python trie
without path compression, fed lazily from the sequence's tokens at each proposal: O(max_depth)
dict operations per token and no native extension. `arctic-inference` ships this tree as a C++
extension, but on PyPI only as a source distribution whose build needs CMake, a C++20 compiler,
nanobind, Python's development files and torch in an isolated build environment (its other modules
target vLLM); `pip install arctic-inference` fails here at that build (CMake finds no Python
development module), so it cannot be a CPU worker's dependency. This module follows its path rules
without its code; its compiled tree, built by hand, gives the same drafts wherever no two children
tie on their count (tests/test_spec_suffix.py compares them when it is importable).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_DEPTH = 24
DEFAULT_MAX_CACHED_REQUESTS = 256
DEFAULT_MAX_CACHED_TOKENS = 1 << 16
DEFAULT_MIN_TOKEN_PROB = 0.1
DEFAULT_MAX_SPEC_FACTOR = 1.0


class _Node:
    __slots__ = ("count", "children", "top", "top_token")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}
        self.top: _Node | None = None  # its most frequent child (the first to reach that count), None: unknown
        self.top_token = 0


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Counts of every substring (up to `max_depth` tokens) of the sequences it holds, by id."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH):
        if max_depth < 1:
            raise ValueError(f"suffix tree depth `{max_depth}` is not accepted. Accepted: >= 1")
        self.max_depth = max_depth
        self.root = _Node()
        self.nodes = 0  # nodes below the root (the memory held)
        self._seqs: dict[Hashable, list[int]] = {}
        self._open: dict[Hashable, list[_Node]] = {}  # per sequence, the suffixes still shorter than max_depth

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def tokens(self, seq_id: Hashable) -> int:
        return len(self._seqs.get(seq_id, ()))

    def extend(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq_id` (a new id starts an empty one)."""
        seq = self._seqs.setdefault(seq_id, [])
        window = self._open.setdefault(seq_id, [])
        root, depth = self.root, self.max_depth
        for token in tokens:
            seq.append(token)
            window.append(root)  # the suffix starting at this token
            for i in range(len(window)):
                node = window[i]
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.nodes += 1
                child.count += 1
                if node.top is None or child.count > node.top.count:
                    node.top, node.top_token = child, token
                window[i] = child
            root.count += 1
            if len(window) >= depth:  # the oldest suffix reached max_depth tokens
                del window[0]

    def remove(self, seq_id: Hashable) -> None:
        """Forget sequence `seq_id`: every count it added, every node only it held."""
        seq = self._seqs.pop(seq_id, None)
        self._open.pop(seq_id, None)
        if seq is None:
            return
        for start in range(len(seq)):
            node = self.root
            node.count -= 1
            for token in seq[start:start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if node.top is child:
                    node.top = None  # found again when a draft needs it
                if child.count == 0:  # nothing below it is held either
                    del node.children[token]
                    self.nodes -= _size(child)
                    break
                node = child

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
                  max_spec_offset: float = 0.0, min_token_prob: float = DEFAULT_MIN_TOKEN_PROB) -> Draft:
        """The best path draft continuing `context` (see the module docstring); empty when nothing matches."""
        best = Draft()
        context = list(context[-self.max_depth:])
        for m in range(1, len(context)):
            node = self.root
            for token in context[len(context) - m:]:
                node = node.children.get(token)
                if node is None:
                    return best
            node_count = node.count
            limit = max(0, min(max_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6)))
            tokens, probs, prob = [], [], 1.0
            while len(tokens) < limit and node.children:
                if node.top is None:
                    node.top_token, node.top = max(node.children.items(), key=_count)
                token, child = node.top_token, node.top
                prob *= child.count / node.count
                if prob < min_token_prob:
                    break
                tokens.append(token)
                probs.append(prob)
                node = child
            score = sum(probs)
            if score >= best.score:
                best = Draft(tuple(tokens), tuple(probs), score, m)
                if score >= max_tokens:  # a certain draft of full length: longer matches draft the same
                    break
            if node_count <= 1 and limit >= max_tokens:  # one occurrence left: longer matches draft the same
                break
        return best


def _count(item: tuple[int, _Node]) -> int:
    return item[1].count


def _size(node: _Node) -> int:
    """Nodes in the subtree under and including `node`."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += 1
        stack.extend(n.children.values())
    return total


class SuffixProposer:
    """Drafts for running requests from their own tree and the global tree of recent outputs;
    engine thread only. Keys are the engine's sequence uids (never reused)."""

    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
                 max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS, min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
                 max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR, max_spec_offset: float = 0.0):
        if max_cached_requests < 0 or max_cached_tokens < 0:
            raise ValueError(f"suffix cache bounds `{max_cached_requests}` requests, `{max_cached_tokens}` tokens "
                             f"are not accepted. Accepted: >= 0")
        self.max_depth, self.min_token_prob = max_depth, min_token_prob
        self.max_cached_requests, self.max_cached_tokens = max_cached_requests, max_cached_tokens
        self.max_spec_factor, self.max_spec_offset = max_spec_factor, max_spec_offset
        self.global_tree = SuffixTree(max_depth)
        self._cached: dict[Hashable, int] = {}  # request -> its output tokens in the global tree, oldest first
        self._cached_tokens = 0
        self._local: dict[Hashable, tuple[SuffixTree, int]] = {}  # request -> (its tree, output tokens fed)
        self.indexing_seconds = 0.0  # spent indexing requests' prompts (once per request, not per step)

    def propose(self, key: Hashable, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens continuing `prompt_ids + output_ids` of request `key`. With `k` 0
        nothing is fed either: a step that will not speculate pays nothing, and the trees catch up
        with the tokens they missed at the request's next draft."""
        if k < 1:
            return []
        self._feed(key, prompt_ids, output_ids)
        context = (list(prompt_ids[-self.max_depth:]) + list(output_ids[-self.max_depth:]))[-self.max_depth:]
        args = (context, k, self.max_spec_factor, self.max_spec_offset, self.min_token_prob)
        local = self._local[key][0].speculate(*args)
        shared = self.global_tree.speculate(*args)
        return list((local if local.score >= shared.score else shared).token_ids)

    def retire(self, live: set) -> None:
        """Drop the own trees of requests not in `live` (their outputs stay in the global tree)."""
        for key in [k for k in self._local if k not in live]:
            del self._local[key]

    def _feed(self, key: Hashable, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        entry = self._local.get(key)
        if entry is None:  # a new request (or one back from preemption): its tree, a fresh global slot
            started = time.perf_counter()
            tree = SuffixTree(self.max_depth)
            tree.extend(0, list(prompt_ids) + list(output_ids))
            self._local[key] = (tree, len(output_ids))
            self._uncache(key)
            if self.max_cached_requests and self.max_cached_tokens:
                self._cached[key] = 0
                self._add_output(key, output_ids)
            self.indexing_seconds += time.perf_counter() - started
            return
        tree, fed = entry
        new = list(output_ids[fed:])
        if new:
            tree.extend(0, new)
            self._local[key] = (tree, len(output_ids))
            if key in self._cached:
                self._add_output(key, new)

    def _add_output(self, key: Hashable, tokens: Sequence[int]) -> None:
        self.global_tree.extend(key, tokens)
        self._cached[key] += len(tokens)
        self._cached_tokens += len(tokens)
        while len(self._cached) > 1 and (len(self._cached) > self.max_cached_requests
                                         or self._cached_tokens > self.max_cached_tokens):
            self._uncache(next(iter(self._cached)))

    def _uncache(self, key: Hashable) -> None:
        if key in self._cached:
            self._cached_tokens -= self._cached.pop(key)
            self.global_tree.remove(key)
