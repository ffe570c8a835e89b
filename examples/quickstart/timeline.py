"""Render the demo's timeline as one self-contained SVG (no scripts, no external files).

One row per task. Along each row, one bar per owner of the task's lease:

- solid: the owner held the lease and was running;
- faded with a dashed edge: the owner was killed, its lease not yet run out;
- hatched: the owner was paused (SIGSTOP);
- thin: the paused owner resumed and finished its body without the lease.

Marks: an orange circle where a recovery pass re-published the task, a red
cross where a stale outcome was refused, a check where the outcome was
accepted. Vertical lines are the demo's actions (SIGKILL, SIGSTOP, ...).
All times are milliseconds on one clock (the lease store's server clock).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

PALETTE = ["#4e79a7", "#b07aa1", "#59a14f", "#f28e2b", "#76b7b2", "#edc948", "#9c755f"]


@dataclass
class Segment:
    start: int
    end: int
    worker: str
    token: int
    style: str = "held"     #: held | orphaned | paused | stale


@dataclass
class Mark:
    at: int
    kind: str               #: recovered | refused | accepted
    text: str = ""
    token: int | None = None    #: the owner it belongs to (its lane), if any


@dataclass
class Row:
    label: str
    segments: list[Segment] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)


def lanes(segments: list[Segment]) -> dict[int, int]:
    """Lane of each owner (token) of one row: owners that overlap in time get separate lanes.

    Two owners overlap when a paused one wakes up after its successor took
    over: both believe they own the task, and the picture shows both.
    """
    spans: dict[int, list[int]] = {}
    for seg in segments:
        lo, hi = spans.setdefault(seg.token, [seg.start, seg.end])
        spans[seg.token] = [min(lo, seg.start), max(hi, seg.end)]
    lane_end: list[int] = []
    out = {}
    for token, (lo, hi) in sorted(spans.items(), key=lambda item: item[1][0]):
        for i, busy_until in enumerate(lane_end):
            if busy_until <= lo:
                lane_end[i] = hi
                out[token] = i
                break
        else:
            out[token] = len(lane_end)
            lane_end.append(hi)
    return out


def render(rows: list[Row], events: list[tuple[int, str]], origin: int, start: int, end: int,
           title: str, workers: list[str]) -> str:
    """The SVG document. ``events`` are (ms, label) drawn as vertical lines; the axis counts
    seconds from ``origin`` and shows ``start`` to ``end``."""
    left, right, row_h, bar_h = 96, 24, 40, 16
    width = 980
    plot_w = width - left - right
    span = max(1, end - start)

    def x(ms: int) -> float:
        return round(left + plot_w * (min(max(ms, start), end) - start) / span, 1)

    # the demo's actions: close ones share a label, label lines alternate
    groups: list[list] = []
    for at, label in sorted(events):
        if groups and x(at) - x(groups[-1][0]) < 8:
            groups[-1][1].append(label)
        else:
            groups.append([at, [label]])
    label_lines = 1 if len(groups) < 2 else 2
    top = 52 + 13 * label_lines
    height = top + row_h * len(rows) + 100

    colour = {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(workers)}
    out = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" '
         f'font-size="12">'),
        "<defs>",
    ]
    for name, c in colour.items():
        out.append(f'<pattern id="hatch-{_id(name)}" width="6" height="6" patternUnits="userSpaceOnUse" '
                   f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/>'
                   f'<rect width="3" height="6" fill="{c}" fill-opacity="0.55"/></pattern>')
    out += ["</defs>", f'<rect width="{width}" height="{height}" fill="#fff"/>',
            f'<text x="{left}" y="24" font-size="16" font-weight="bold">{escape(title)}</text>']

    # time axis: a tick every second (every 5 s on long runs)
    step = 1000 if span <= 40_000 else 5000
    axis_y = top - 6
    first = -((origin - start) // step) * step
    for ms in range(first, end - origin + 1, step):
        tx = x(origin + ms)
        out.append(f'<line x1="{tx}" y1="{axis_y}" x2="{tx}" y2="{top + row_h * len(rows)}" '
                   f'stroke="#eee"/>')
        out.append(f'<text x="{tx}" y="{axis_y - 4}" text-anchor="middle" fill="#888" '
                   f'font-size="10">{ms // 1000}s</text>')

    for i, (at, labels) in enumerate(groups):
        ex = x(at)
        out.append(f'<line x1="{ex}" y1="{38 + 13 * (i % label_lines)}" x2="{ex}" '
                   f'y2="{top + row_h * len(rows)}" stroke="#c00" stroke-width="1" '
                   f'stroke-dasharray="4 3" opacity="0.6"/>')
        anchor = "end" if ex > width - 200 else "start"
        out.append(f'<text x="{ex + (-3 if anchor == "end" else 3)}" y="{46 + 13 * (i % label_lines)}" '
                   f'text-anchor="{anchor}" fill="#a00" font-size="10">{escape(" · ".join(labels))}</text>')

    for r, row in enumerate(rows):
        y = top + r * row_h
        if r % 2:
            out.append(f'<rect x="0" y="{y}" width="{width}" height="{row_h}" fill="#000" fill-opacity="0.03"/>')
        mid = y + row_h / 2
        lane_of = lanes(row.segments)
        two = len(set(lane_of.values())) > 1
        h = bar_h if not two else 13
        centre = _centres(lane_of, mid) if two else {}
        out.append(f'<text x="{left - 8}" y="{mid + 4}" text-anchor="end" '
                   f'font-family="DejaVu Sans Mono, monospace">{escape(row.label)}</text>')
        firsts = {}
        for seg in row.segments:
            firsts.setdefault(seg.token, seg.start)
        for seg in row.segments:
            x0, x1 = x(seg.start), x(seg.end)
            w = max(1.0, round(x1 - x0, 1))
            c = colour.get(seg.worker, "#999")
            cy = centre.get(seg.token, mid)
            tip = f"{seg.worker}, token {seg.token}: {seg.style}"
            if seg.style == "stale":
                out.append(f'<rect x="{x0}" y="{cy - 3}" width="{w}" height="6" fill="{c}" '
                           f'fill-opacity="0.45"><title>{escape(tip)}</title></rect>')
                continue
            attrs = {"held": f'fill="{c}"',
                     "orphaned": f'fill="{c}" fill-opacity="0.25" stroke="{c}" stroke-dasharray="3 2"',
                     "paused": f'fill="url(#hatch-{_id(seg.worker)})" stroke="{c}"'}[seg.style]
            out.append(f'<rect x="{x0}" y="{cy - h / 2}" width="{w}" height="{h}" rx="2" '
                       f'{attrs}><title>{escape(tip)}</title></rect>')
            # leave room for a recovery mark at the start of a successor's bar
            pad = 4 if seg.start == min(firsts.values()) else 9
            if seg.style == "held" and w > 40 + pad:
                out.append(f'<text x="{x0 + pad}" y="{cy + 4}" fill="#fff" font-size="11">'
                           f'{escape(seg.worker)} · t{seg.token}</text>')
        for mark in row.marks:
            out.append(_mark(mark, x(mark.at), centre.get(mark.token, mid)))

    # legend: workers on one line, marks on the next; an item that does not fit wraps
    gray = "#888"
    items = [(f'<rect x="{{x}}" y="{{y}}" width="14" height="12" fill="{c}"/>', 18, f"worker {name}")
             for name, c in colour.items()]
    items.append(None)   # line break
    marks = [
        ((f'<rect x="{{x}}" y="{{y}}" width="22" height="12" fill="{gray}" fill-opacity="0.25" '
          f'stroke="{gray}" stroke-dasharray="3 2"/>'), 28, "killed, lease not yet run out", "orphaned"),
        ('<rect x="{x}" y="{y}" width="22" height="12" fill="url(#hatch-legend)" stroke="#888"/>',
         28, "paused", "paused"),
        (f'<rect x="{{x}}" y="{{y3}}" width="22" height="6" fill="{gray}" fill-opacity="0.45"/>', 28,
         "resumed without the lease", "stale"),
        ('<circle cx="{cx}" cy="{cy}" r="5.5" fill="#f28e2b"/>', 16, "recovered", "recovered"),
        (('<g stroke="#d62728" stroke-width="3"><line x1="{x}" y1="{y}" x2="{x12}" y2="{y12}"/>'
          '<line x1="{x}" y1="{y12}" x2="{x12}" y2="{y}"/></g>'), 18, "stale outcome refused", "refused"),
        ('<path d="M{x},{cy} l4,5 l7,-10" fill="none" stroke="#222" stroke-width="2.5"/>', 16,
         "outcome accepted", "accepted"),
    ]
    # Only what this picture contains: a run without a refusal (or a kill) shows no such entry.
    drawn = {seg.style for row in rows for seg in row.segments} | {m.kind for row in rows for m in row.marks}
    items += [(shape, gap, text) for shape, gap, text, kind in marks if kind in drawn]
    lx, ly = left, top + row_h * len(rows) + 28
    for item in items:
        if item is None:
            lx, ly = left, ly + 22
            continue
        shape, gap, text = item
        w = gap + 7 * len(text) + 22
        if lx + w > width - right:
            lx, ly = left, ly + 22
        y = ly - 10
        out.append(shape.format(x=lx, y=y, y3=y + 3, cx=lx + 6, cy=y + 6, x12=lx + 12, y12=y + 12) +
                   f'<text x="{lx + gap}" y="{ly}">{escape(text)}</text>')
        lx += w
    out.insert(out.index("</defs>"),
               '<pattern id="hatch-legend" width="6" height="6" patternUnits="userSpaceOnUse" '
               'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/>'
               '<rect width="3" height="6" fill="#888" fill-opacity="0.55"/></pattern>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _centres(lane_of: dict[int, int], mid: float) -> dict[int, float]:
    """Vertical centre of each owner's bar in a row split into two lanes (first owner on top)."""
    return {token: mid + 7.5 if lane else mid - 7.5 for token, lane in lane_of.items()}


def _mark(mark: Mark, mx: float, cy: float) -> str:
    tip = f"<title>{escape(mark.text)}</title>" if mark.text else ""
    if mark.kind == "recovered":
        return f'<circle cx="{mx}" cy="{cy}" r="5.5" fill="#f28e2b" stroke="#fff">{tip}</circle>'
    if mark.kind == "refused":
        label = (f'<text x="{mx + 9}" y="{cy + 4}" fill="#d62728" font-size="10">{escape(mark.text)}</text>'
                 if mark.text else "")
        return (f'<g stroke="#d62728" stroke-width="3">{tip}'
                f'<line x1="{mx - 5}" y1="{cy - 5}" x2="{mx + 5}" y2="{cy + 5}"/>'
                f'<line x1="{mx - 5}" y1="{cy + 5}" x2="{mx + 5}" y2="{cy - 5}"/></g>{label}')
    return (f'<path d="M{mx - 5},{cy} l4,5 l7,-10" fill="none" stroke="#222" '
            f'stroke-width="2.5">{tip}</path>')


def _id(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)
