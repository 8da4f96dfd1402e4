"""bench/trace_report.py on a synthetic timeline with known stage times (no GPU needed).

The file layout is the one src/sm90/attention_launch.cuh writes in a -DSAGE_SM90_TRACE=1 build:
six int32 (magic, D, grid CTAs, recorded CTAs, roles, events per role), then
[recorded CTAs][roles][events] uint64 words of (clock << 8) | event.
"""

import importlib.util
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("trace_report", ROOT / "bench" / "trace_report.py")
trace_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_report)
E = trace_report.E


def consumer_item(t, n_tiles, q=100, tile=1000):
    """One item's events from clock t: Q ready after q, tiles of `tile` cycles (kv wait 10,
    QK wait 20, softmax 600, PV wait 5, the rest fold and pack), then the last PV (50), the
    last fold (30), the epilogue (400). Returns (events, end clock)."""
    ev = [(t, E["item_begin"])]
    t += q
    ev.append((t, E["q_ready"]))
    # tile 0: no PV of its own
    ev += [(t + 10, E["kv_full"]), (t + 30, E["s_ready"]), (t + 630, E["softmax_done"]),
           (t + tile, E["tile_done"])]
    t += tile
    for _ in range(1, n_tiles):
        ev += [(t + 10, E["kv_full"]), (t + 30, E["s_ready"]), (t + 630, E["softmax_done"]),
               (t + 635, E["pv_done"]), (t + tile, E["tile_done"])]
        t += tile
    ev += [(t + 50, E["pv_done"]), (t + 80, E["epilogue_begin"]), (t + 480, E["epilogue_end"])]
    return ev, t + 480


def write_trace(path, roles_events, grid=16, ctas=2, roles=5, events=64):
    words = [0] * (ctas * roles * events)
    for (c, r), ev in roles_events.items():
        for i, (clock, code) in enumerate(ev):
            words[(c * roles + r) * events + i] = (clock << 8) | code
    with open(path, "wb") as f:
        f.write(struct.pack("<6i", 0x53414745, 128, grid, ctas, roles, events))
        f.write(struct.pack(f"<{len(words)}Q", *words))


def test_stage_times_of_a_synthetic_timeline(tmp_path, capsys):
    roles_events = {}
    for c in range(2):
        for r in (1, 2):  # two consumer warpgroups
            first, t = consumer_item(1000, 4, q=3000)
            second, t = consumer_item(t + 20, 4)
            # A third item cut off after its first K/V tile (the buffer's end).
            third, _ = consumer_item(t + 20, 4)
            roles_events[c, r] = first + second + third[:4]
    path = tmp_path / "trace.bin"
    write_trace(path, roles_events)

    d, grid, ctas, roles, table = trace_report.read_trace(path)
    assert (d, grid, ctas, roles) == (128, 16, 2, 5)
    items = trace_report.split_items(table[0, 1])
    assert len(items) == 3
    st, n = trace_report.item_stages(items[1], None)
    assert n == 4
    assert st["Q ready"] == 100
    assert st["loop per tile: total"] == 1000
    assert st["loop per tile: softmax"] == 600
    assert st["loop per tile: QK wait"] == 20
    assert st["loop per tile: PV wait"] == 5
    assert st["last PV wait"] == 50 and st["last fold"] == 30 and st["epilogue"] == 400
    assert st["item total"] == 100 + 4 * 1000 + 480
    st0, _ = trace_report.item_stages(items[0], items[1][0][0])
    try:
        trace_report.item_stages(items[2], None)
    except IndexError:
        pass
    else:
        raise AssertionError("a cut-off item gave stage times")
    assert st0["Q ready"] == 3000 and st0["to next item"] == 20

    # The report: CTA 1 of a 16-CTA grid is CTA 8, a later wave with --sms 4.
    trace_report.report(str(path), 0.0, 4)
    out = capsys.readouterr().out
    assert "first item, first-wave CTAs (2 items, 4 tiles)" in out
    assert "first item, later CTAs (2 items, 4 tiles)" in out
    assert "| Q ready | 3000 | 3000 | 100 |" in out
    assert "4 item(s) left out: incomplete events" in out


def test_rejects_a_file_that_is_not_a_trace(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\0" * 64)
    try:
        trace_report.read_trace(path)
    except SystemExit as e:
        assert "not a sagekit trace" in str(e)
    else:
        raise AssertionError("read_trace accepted a file without the magic")
