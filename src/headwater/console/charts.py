"""Small SVG line charts drawn on the server (no script, no external library)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

from markupsafe import Markup

COLORS = 7  # console.css colours lines and legend keys .c0 ... .c6
WIDTH, HEIGHT, PAD = 360, 90, 4


def line_chart(
    title: str, lines: Mapping[str, Sequence[tuple[float, float]]], unit: str = ""
) -> Markup:
    """An SVG of ``lines`` (name -> (time, value) points) sharing one time and value axis,
    with the title, the latest value of each line and its colour as the legend."""
    points = [p for pts in lines.values() for p in pts]
    legend = []
    paths = []
    if points:
        t0 = min(t for t, _ in points)
        t1 = max(max(t for t, _ in points), t0 + 1)
        top = max(max(v for _, v in points), 1e-9)
        for i, (name, pts) in enumerate(sorted(lines.items())):
            color = f"c{i % COLORS}"
            xy = " ".join(
                f"{PAD + (t - t0) / (t1 - t0) * (WIDTH - 2 * PAD):.1f},"
                f"{HEIGHT - PAD - v / top * (HEIGHT - 2 * PAD):.1f}"
                for t, v in pts
            )
            if xy:
                paths.append(f'<polyline class="{color}" points="{xy}"/>')
            last = pts[-1][1] if pts else 0.0
            legend.append(  # a class, not a style attribute: the CSP refuses inline styles
                f'<span class="key {color}">{escape(name)}: {_number(last)}{escape(unit)}</span>'
            )
        scale = f"max {_number(top)}{escape(unit)}"
    else:
        scale = "no points yet"
    svg = (
        f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(title)}"><rect width="{WIDTH}" height="{HEIGHT}" class="plot"/>'
        f"{''.join(paths)}</svg>"
    )
    return Markup(
        f'<figure class="chart"><figcaption>{escape(title)} <small>({scale}, last hour)</small>'
        f'</figcaption>{svg}<div class="legend">{"".join(legend)}</div></figure>'
    )


def _number(v: float) -> str:
    if v < 0.001:
        return "0"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"
