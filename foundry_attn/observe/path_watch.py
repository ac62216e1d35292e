"""What changed on a model's path since the glue last looked: the one poll every trainer's glue makes after a batch.

    watch = PathWatch(path_of(hf_model))      # at the run's start
    ...
    for what in watch.changed():              # after each batch: "path", "layout", "execution", in that order
        events.append("attn_impl", **decision_of(hf_model), at=what)

``path``: a proof moved the run (a :class:`~foundry_attn.path.state.PathChange`); ``layout``: the batch ran another
layout than the last (flat or rows); ``execution``: the first flat batch's device settled another execution (graphed
without CUDA). Core module: torch and transformers only.
"""

from __future__ import annotations

from foundry_attn.path.state import PathState


class PathWatch:
    """The path's changes, layout and execution as last seen.

    Args:
        state: the model's :class:`~foundry_attn.path.state.PathState`.
    """

    def __init__(self, state: PathState) -> None:
        self.state = state
        self._seen = self._now()

    def _now(self) -> tuple[int, str, str]:
        return len(self.state.changes), self.state.choice.layout, self.state.execution.runs

    def changed(self) -> tuple[str, ...]:
        """What changed since the last call (or the watch began), and take it as seen.

        Returns:
            Some of ``"path"``, ``"layout"``, ``"execution"``, in that order (empty: nothing).

        Example::

            >>> from foundry_attn.path.state import path_of
            >>> watch = PathWatch(path_of(hf_model))  # hf_model: attached
            >>> watch.changed()  # nothing since the watch began
            ()
            >>> path_of(hf_model).to_rows("proof at batch 3 failed: ...")  # what a failed proof does
            >>> watch.changed(), watch.changed()  # said once
            (('path',), ())
        """
        now = self._now()
        changed = tuple(
            name for name, a, b in zip(("path", "layout", "execution"), self._seen, now, strict=True) if a != b
        )
        self._seen = now
        return changed
