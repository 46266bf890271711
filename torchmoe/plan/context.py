"""Context parallelism, planned: which tokens each cp rank holds, and what each attention layer
must communicate for them.

    python -c "from torchmoe.plan.context import CPLayout; l = CPLayout(seq_len=16, cp=2); \\
        print(l.positions(0), l.mode(4), l.mode(3), l.mode(None, window=4))"

Layout: head-tail. Each sequence is cut into ``2 * cp`` pieces of ``P = seq_len / (2 cp)`` tokens;
cp rank r holds pieces r and ``2 cp - 1 - r`` (an early and a late piece), concatenated. Causal
attention over the whole prefix then costs every rank the same (with contiguous slices the last
rank would do ``2 cp - 1`` times the first rank's work), and chunked attention stays local as long
as chunks do not cross piece boundaries.

What each attention layer needs beyond its own tokens (Llama 4 mixes both kinds):
    global     NoPE layers (and chunked ones whose chunk is no shorter than the sequence): keys and
               values of the whole prefix. All-gathered over cp (gradients summed back), the mask
               built from global positions.
    local      chunked layers whose chunk divides P: every piece holds whole chunks, so nothing is
               sent at all.
    halo       chunked layers whose chunk is shorter than P but does not divide it: a piece's first
               chunk started in the previous piece, so the previous piece's last
               ``start mod chunk`` keys and values come point to point from its owner (and their
               gradients go back); at most chunk - 1 tokens per piece.
    gather     chunked layers whose chunk is longer than P (a chunk spans several pieces, hence
               several ranks): all-gathered like global layers, masked to the chunk.
Sliding-window layers (gpt-oss's, window W shorter than the sequence) see the W - 1 keys before a
query: halo mode (the previous piece's last W - 1 keys) when W - 1 <= P, gather mode (the
W - 1 keys before each piece, from the gathered ones) when a window spans more than one piece,
local when W = 1. Sinks are per query and need nothing.
Contiguous slices would need whole chunks only per slice (``seq_len / cp``), half as strict, but
leave the global layers' causal work unbalanced; head-tail is the trade torchmoe makes, and the
dry run names each layer's mode and bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

GLOBAL, LOCAL, HALO, GATHER = "global", "local", "halo", "gather"


@dataclass(frozen=True)
class CPLayout:
    """The head-tail split of one sequence of `seq_len` tokens over `cp` ranks."""

    seq_len: int
    cp: int

    @property
    def piece(self) -> int:
        """Tokens per piece, P."""
        return self.seq_len // (2 * self.cp)

    def pieces(self, rank: int) -> tuple[int, int]:
        """The two pieces `rank` holds, in the order its tokens are laid out."""
        return rank, 2 * self.cp - 1 - rank

    def owner(self, piece: int) -> int:
        """The cp rank holding `piece`."""
        return piece if piece < self.cp else 2 * self.cp - 1 - piece

    def positions(self, rank: int) -> list[int]:
        """Global positions of `rank`'s tokens, in its order."""
        p = self.piece
        return [j * p + i for j in self.pieces(rank) for i in range(p)]

    def window(self, window: int | None) -> int | None:
        """A sliding window as it binds on this sequence: None when it is none or no shorter."""
        return window if window is not None and window < self.seq_len else None

    def mode(self, chunk: int | None, window: int | None = None) -> str:
        """How an attention layer with chunk size `chunk` (None: full causal), or with a sliding
        `window` (a layer has one or the other), runs under CP."""
        if (window := self.window(window)) is not None:
            return LOCAL if window == 1 else HALO if window - 1 <= self.piece else GATHER
        if chunk is None or chunk >= self.seq_len:
            return GLOBAL
        if self.piece % chunk == 0:
            return LOCAL
        return HALO if chunk < self.piece else GATHER

    def halo(self, piece: int, chunk: int | None, window: int | None = None) -> int:
        """Tokens of the previous piece that `piece`'s first chunk covers, or that its first
        query's sliding window reaches (halo mode)."""
        if (window := self.window(window)) is not None:
            return min(window - 1, piece * self.piece)
        return piece * self.piece % chunk

    def keys(self, piece: int, chunk: int | None, window: int | None = None) -> int:
        """Keys the queries of `piece` attend over (global / gather / halo modes): its prefix, its
        chunks up to its end, its sliding window's reach before it plus itself, or itself plus
        its halo."""
        mode, p, window = self.mode(chunk, window), self.piece, self.window(window)
        if mode == GLOBAL:
            return (piece + 1) * p
        if mode == GATHER and window is not None:
            return p + min(window - 1, piece * p)
        if mode == GATHER:
            return (piece + 1) * p - piece * p // chunk * chunk
        return p + (self.halo(piece, chunk, window) if mode == HALO and piece else 0)

    def prefix(self, piece: int, chunk: int | None, window: int | None = None) -> int:
        """Keys before its own that `piece`'s queries attend over (what `keys` adds to the piece)."""
        return self.keys(piece, chunk, window) - self.piece if self.mode(chunk, window) != LOCAL else 0

    def attention_calls(self, rank: int, spans: tuple[tuple[int | None, int | None], ...]
                        ) -> list[tuple[int | None, int, int, int, int | None]]:
        """The attention calls `rank` makes per row, for layers with each (chunk, sliding window)
        of `spans`: (chunk the call cuts at, None in global mode; its first query's global
        position; queries; prefix keys; the window), one per local piece, in the order its tokens
        are laid out."""
        p = self.piece
        return [(None if self.mode(chunk, window) == GLOBAL else chunk, piece * p, p, self.prefix(piece, chunk, window),
                 self.window(window)) for chunk, window in spans for piece in self.pieces(rank)]

    def bytes_received(self, mode: str, chunk: int | None, kv_bytes_per_token: float,
                       window: int | None = None) -> float:
        """Key/value bytes one rank receives per sequence in forward under `mode` (its gradients
        travel back in backward, the same amount again): the analytic minimum for the layout."""
        if mode in (GLOBAL, GATHER):
            return (self.cp - 1) / self.cp * self.seq_len * kv_bytes_per_token
        if mode == HALO:
            # Per rank, the larger of the ranks' halo totals (what the slowest rank waits for).
            per_rank = [sum(self.halo(j, chunk, window) for j in self.pieces(r) if j and self.owner(j - 1) != r)
                        for r in range(self.cp)]
            return max(per_rank) * kv_bytes_per_token
        return 0.0
