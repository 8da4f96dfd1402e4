#!/usr/bin/env python3
"""The attention kernel's timeline (src/sm90/trace.cuh) as a table of stage times.

Input: a file written by a -DSAGE_SM90_TRACE=1 build (SAGE_TRACE_OUT=FILE sage bench ...),
holding (SM clock, event) pairs of the first CTAs' producer thread, one thread per consumer
warpgroup and the Q stage's first thread. Output: per consumer item, the mean cycles of each
stage (the Q prologue or the stage's wait, the first tile, the K/V loop per tile split into its
waits and its work, the last PV, the epilogue), over every recorded item, a CTA's first item
apart from the others (the consumers quantize its Q themselves), and a first-wave CTA's
(launched in lock-step with the whole first wave) apart from a later wave's.

Usage: python3 bench/trace_report.py TRACE [TRACE ...] [--mhz SM_CLOCK]
"""
import argparse
import struct
import sys
from collections import defaultdict

EVENTS = ["", "item_begin", "q_ready", "kv_full", "s_ready", "softmax_done", "pv_done",
          "tile_done", "epilogue_begin", "epilogue_end", "kv_issued", "stage_begin", "stage_end"]
E = {name: i for i, name in enumerate(EVENTS) if name}


def read_trace(path):
    with open(path, "rb") as f:
        magic, d, grid, ctas, roles, events = struct.unpack("<6i", f.read(24))
        if magic != 0x53414745:
            sys.exit(f"{path}: not a sagekit trace")
        raw = f.read()
    vals = struct.unpack(f"<{ctas * roles * events}Q", raw)
    table = {}
    for c in range(ctas):
        for r in range(roles):
            row = vals[(c * roles + r) * events:(c * roles + r + 1) * events]
            table[c, r] = [(v >> 8, v & 0xFF) for v in row if v]
    return d, grid, ctas, roles, table


def split_items(events):
    """A consumer's events into items, each a list of (cycle, code) from its item_begin."""
    items = []
    for cyc, code in events:
        if code == E["item_begin"]:
            items.append([])
        if items:
            items[-1].append((cyc, code))
    return items


def item_stages(item, next_begin):
    """Cycles per stage of one item (keys in report order) and its K/V tile count."""
    at = defaultdict(list)
    for cyc, code in item:
        at[EVENTS[code]].append(cyc)
    n = len(at["kv_full"])
    st = {}
    t0 = at["item_begin"][0]
    st["Q ready"] = at["q_ready"][0] - t0
    st["tile 0: K/V wait"] = at["kv_full"][0] - at["q_ready"][0]
    st["tile 0: QK wait"] = at["s_ready"][0] - at["kv_full"][0]
    st["tile 0: softmax"] = at["softmax_done"][0] - at["s_ready"][0]
    st["tile 0: pack"] = at["tile_done"][0] - at["softmax_done"][0]
    loop = defaultdict(float)
    for i in range(1, n):
        loop["K/V wait"] += at["kv_full"][i] - at["tile_done"][i - 1]
        loop["QK wait"] += at["s_ready"][i] - at["kv_full"][i]
        loop["softmax"] += at["softmax_done"][i] - at["s_ready"][i]
        loop["PV wait"] += at["pv_done"][i - 1] - at["softmax_done"][i]
        loop["fold, pack"] += at["tile_done"][i] - at["pv_done"][i - 1]
    for k, v in loop.items():
        st["loop per tile: " + k] = v / (n - 1)
    st["loop per tile: total"] = (at["tile_done"][n - 1] - at["tile_done"][0]) / (n - 1) if n > 1 else 0.0
    st["last PV wait"] = at["pv_done"][-1] - at["tile_done"][-1]
    st["last fold"] = at["epilogue_begin"][0] - at["pv_done"][-1]
    st["epilogue"] = at["epilogue_end"][0] - at["epilogue_begin"][0]
    end = next_begin if next_begin is not None else at["epilogue_end"][0]
    st["to next item"] = end - at["epilogue_end"][0]
    st["item total"] = end - t0
    st["item outside the loop"] = st["item total"] - st["loop per tile: total"] * (n - 1)
    return st, n


def report(path, mhz, sms):
    d, grid, ctas, roles, table = read_trace(path)
    stride = max(1, grid // ctas)
    first_wave, later_wave, later = ("first item, first-wave CTAs", "first item, later CTAs",
                                     "later items")
    groups = {first_wave: defaultdict(list), later_wave: defaultdict(list), later: defaultdict(list)}
    tiles = defaultdict(list)
    skipped = 0  # items whose events are incomplete: said below, not dropped silently
    for c in range(ctas):
        for r in range(1, roles - 1):
            items = split_items(table[c, r])
            for k, item in enumerate(items):
                nxt = items[k + 1][0][0] if k + 1 < len(items) else None
                try:
                    st, n = item_stages(item, nxt)
                except (IndexError, ZeroDivisionError):
                    skipped += 1  # cut off by the buffer's end, or no K/V tile (causal)
                    continue
                key = later if k else (first_wave if c * stride < sms else later_wave)
                for name, v in st.items():
                    groups[key][name].append(v)
                tiles[key].append(n)
    print(f"## {path}: d = {d}, {grid} CTAs; recorded: CTAs 0, {stride}, {2 * stride}, .. ({ctas});"
          f" the first wave: CTAs below {sms}")
    print()
    heads = [k for k in groups if groups[k]]
    print("| stage (mean cycles" + (f"; us at {mhz} MHz" if mhz else "") + ") | " +
          " | ".join(f"{k} ({len(tiles[k]) } items, {sum(tiles[k]) / max(1, len(tiles[k])):.0f} tiles)" for k in heads) + " |")
    print("|---|" + "---:|" * len(heads))
    names = list(groups[heads[0]].keys()) if heads else []
    for name in names:
        cells = []
        for k in heads:
            v = groups[k].get(name, [])
            m = sum(v) / len(v) if v else float("nan")
            cells.append(f"{m:.0f}" + (f" ({m / mhz:.2f})" if mhz else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")
    # The producer's lead: from a K/V tile's TMA issue to the first consumer passing its full
    # barrier (the i-th issue of a CTA is its i-th tile); and the Q stage's time per tile.
    lead, stage = [], []
    for c in range(ctas):
        issued = [cyc for cyc, code in table[c, 0] if code == E["kv_issued"]]
        full = [cyc for cyc, code in table[c, 1] if code == E["kv_full"]]
        lead += [f - i for i, f in zip(issued, full)]
        begin = None
        for cyc, code in table[c, roles - 1]:
            if code == E["stage_begin"]:
                begin = cyc
            elif code == E["stage_end"] and begin is not None:
                stage.append(cyc - begin)
    if lead:
        print(f"\nK/V tile issued (producer) to its full barrier passed (consumer 0): mean {sum(lead) / len(lead):.0f}"
              f" cycles over {len(lead)} tiles")
    if stage:
        print(f"Q stage: mean {sum(stage) / len(stage):.0f} cycles per tile quantized ({len(stage)} tiles)")
    if skipped:
        print(f"{skipped} item(s) left out: incomplete events (the buffer's end, or no K/V tile)")
    print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--mhz", type=float, default=0.0, help="SM clock, to print microseconds too")
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU: CTAs of the first wave")
    args = ap.parse_args()
    for path in args.traces:
        report(path, args.mhz, args.sms)


if __name__ == "__main__":
    main()
