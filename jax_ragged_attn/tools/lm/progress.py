"""The main job's progress bar: tqdm when it is installed, else a plain bar on stderr."""

from __future__ import annotations

import sys


def progress_bar(total: int):
    """Returns (update, close). update(text, done=None) shows `text` beside the bar and moves it to `done`
    steps (one more than before when omitted); close() ends the line."""
    state = {"done": 0}
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total, unit="step", dynamic_ncols=True)

        def update(text, done=None):
            state["done"] = state["done"] + 1 if done is None else done
            bar.set_postfix_str(text, refresh=False)
            bar.update(state["done"] - bar.n)

        return update, bar.close

    def update(text, done=None):
        state["done"] = state["done"] + 1 if done is None else done
        if state["done"] % max(1, total // 50) == 0 or state["done"] == total:  # ~50 redraws in all
            filled = 30 * state["done"] // total
            print(
                f"\r[{'#' * filled}{'.' * (30 - filled)}] {state['done']}/{total} {text}",
                end="",
                file=sys.stderr,
                flush=True,
            )

    return update, lambda: print(file=sys.stderr)
