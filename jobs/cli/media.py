"""Commands on video files: qc and interpolate."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
from rich.markup import escape

from clipmill.jobs.cli.common import (EXIT_BAD_INPUT, BadInput, FiniteRange, SetupError, domain_errors, err, out,
                                      qc_config_options)


@click.command()
@click.argument("files", nargs=-1, type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="JSON Lines: one {path, verdict, reasons, metrics} per file.")
@click.option("--explain", is_flag=True, help="Also print the metric curves over time (with --json: a 'series' key).")
@click.option("--sheet", is_flag=True, help="Write a contact sheet PNG (frames and metric curves) beside each file, "
              "whole or not at all (with --json a failure is the record's 'sheet_error').")
@click.option("--bench", is_flag=True, help="Measure QC instead: confusion table on the synthetic labelled set, and 720p speed.")
@click.option("--max-memory", metavar="SIZE", default=None,
              help="QC holds a whole clip in memory: a file whose frames need more than SIZE (500MB, 2GiB) is refused "
                   "before it is decoded [default: what this host, or its container, has available when the file is "
                   "reached].")
@qc_config_options
def qc(files, as_json, explain, sheet, bench, max_memory, qc_cfg):
    """Check video FILES for broken clips: flicker, garbage or block-corrupted frames, black or
    flat frames, frozen stretches, cuts, over-exposure, boiling texture, a line along the frame's
    edges (a decoder's artefact), collapse into blur.

    Frames are compared with their motion-compensated neighbours, so fast pans and zooms pass.
    A file that cannot be read or checked (missing, a folder, not a video, frames too small to
    measure, a clip too long for memory: QC holds the whole clip, so a file whose frames need
    more than --max-memory is refused before it is decoded) gets an error line naming it
    and why, never a verdict; the other files are still checked, and the exit code is 2 (as it
    is when a --sheet cannot be written: an error line after that file's verdict). Exits 0 when
    every file was read and checked, whatever the verdicts.

    \b
    Example:
      clipmill qc clipmill-out/*/*/a1.mp4 --json
      clipmill qc clip.mp4 --explain --sheet --set min_pair_ssim=0.4
      clipmill qc --bench
    """
    if bench:
        _qc_bench(qc_cfg, as_json)
        return
    if not files:
        raise click.UsageError("give one or more FILES, or --bench")
    from clipmill.jobs.core.preflight import BadOption, check_input_file, parse_memory
    from clipmill.pipeline.video import VideoError, decode
    from clipmill.qc import check_frames_with_series
    from clipmill.qc.check import FrameTooSmall
    from clipmill.qc.report import contact_sheet, explain_lines
    from clipmill.storage.local import write_atomic

    with domain_errors():
        limit = parse_memory(max_memory, "--max-memory") if max_memory is not None else None
    unreadable = unwritten = 0
    for f in files:
        frames = series = None  # the last file's frames are let go before this one's are decoded
        try:
            if check_input_file(f).is_file():  # a pipe is read once: by decode
                _check_memory(f, limit, qc_cfg.max_side)
            frames, fps = decode(f, min_frames=2)  # QC compares frames
            res, series = check_frames_with_series(frames, fps, qc_cfg)
        except (BadOption, VideoError, FrameTooSmall, TooBig, MemoryError) as e:
            unreadable += 1
            if isinstance(e, MemoryError):  # that file's error: the files after it may fit
                shape = frames.shape[:3] if frames is not None else None
                frames = series = e = None
                reason = _out_of_memory(f, shape, qc_cfg.max_side)
            else:
                reason = str(e).removeprefix(f"{f}: ")
            if as_json:
                click.echo(json.dumps({"path": f, "error": reason}, ensure_ascii=False))
            err.print(f"[red]error:[/] {escape(f)}: {escape(reason)}", soft_wrap=True, highlight=False)
            continue
        rec = {"path": f, "verdict": res.verdict, "reasons": res.reasons, "metrics": res.metrics}
        sheet_error = None
        if sheet:  # the verdict stands whether or not its sheet can be written
            png = contact_sheet(frames, series, res)
            try:  # whole or not at all: a full disk or a kill leaves an earlier sheet as it was
                write_atomic(f + ".sheet.png", lambda fh: fh.write(png))
            except OSError as e:
                unwritten += 1
                sheet_error = f"cannot write {f}.sheet.png ({e.strerror or e})"
                rec["sheet_error"] = sheet_error
        if as_json:
            if explain:
                rec["series"] = series.as_lists()
            click.echo(json.dumps(rec, ensure_ascii=False))
        else:
            colour = "green" if rec["verdict"] == "pass" else "red"
            out.print(f"[{colour}]{rec['verdict']}[/] {escape(f)}", soft_wrap=True)
            for r in rec["reasons"]:
                out.print(f"    {r}", markup=False, soft_wrap=True)
            if explain:
                for line in explain_lines(series, fps):
                    out.print("    " + line, markup=False, soft_wrap=True)
        if sheet_error:  # after that file's verdict
            err.print(f"[red]error:[/] --sheet: {escape(sheet_error)}", soft_wrap=True, highlight=False)
    if unreadable or unwritten:
        err.print(", ".join(part for part in (
            f"{unreadable} of {len(files)} file(s) could not be read or checked" if unreadable else "",
            f"{unwritten} contact sheet(s) could not be written" if unwritten else "") if part), highlight=False)
        sys.exit(EXIT_BAD_INPUT)


class TooBig(ValueError):
    """A clip whose frames need more memory than QC may take."""


def _check_memory(path: str, limit: int | None, max_side: int) -> None:
    """TooBig when ``path``'s frames, as decode will make them (``probe``), need more than ``limit`` bytes
    (None: what the host has available now): refused before decoding, since a clip that fits
    the address space but not the memory is not a MemoryError but the kernel's OOM killer,
    which ends the whole run (every file after it unchecked)."""
    from clipmill.jobs.core.preflight import available_memory
    from clipmill.pipeline.video import probe
    from clipmill.qc.check import memory_needed

    info = probe(path)
    n, h, w = info["decoded_frames"], info["height"], info["width"]
    room = limit if limit is not None else available_memory()
    if not (n and h and w) or room is None:
        return
    need = memory_needed(n, h, w, max_side)[0]
    if need > room:
        where = "--max-memory allows" if limit is not None else "this host has available now"
        raise TooBig(f"{n} frames of {w}x{h} need about {need / 1e9:.2f} GB (QC holds the whole clip in memory), "
                     f"more than the {room / 1e9:.2f} GB {where}; check a shorter cut"
                     + (", or raise --max-memory" if limit is not None else ""))


def _out_of_memory(path: str, shape: tuple[int, int, int] | None, max_side: int) -> str:
    """Why QC ran out of memory on ``path``: its frames (``shape``, or as probed when decoding
    failed) and what they need, since QC holds the whole clip in memory."""
    from clipmill.pipeline.video import VideoError, probe
    from clipmill.qc.check import memory_needed

    if shape is None:
        try:
            info = probe(path)
            shape = (info["frames"], info["height"], info["width"])
        except (VideoError, MemoryError):
            pass
    why = "QC holds the whole clip in memory"
    if not shape or not all(shape):
        return f"out of memory decoding it ({why}); check a shorter cut"
    n, h, w = shape
    need, decoded, working = memory_needed(n, h, w, max_side)
    return (f"out of memory: {n} frames of {w}x{h} need about {need / 1e9:.1f} GB ({why}: {decoded / 1e6:.1f} MB "
            f"decoded and {working / 1e6:.1f} MB of working copy a frame); check a shorter cut")


def _qc_bench(cfg, as_json: bool) -> None:
    from rich.table import Table

    from clipmill.qc.bench import boiling_confusion, confusion, speed_720p

    with err.status("QC on the synthetic labelled set (good and broken clips)..."):
        conf = confusion(cfg)
    with err.status("QC on the held-out boiling set (grainy good clips and boiling ones, through H.264)..."):
        boil = boiling_confusion(cfg)
    with err.status("QC speed on a 5-second 720p clip..."):
        speed = speed_720p(cfg)
    if as_json:
        click.echo(json.dumps({"confusion": conf, "boiling": boil, "speed": speed}))
        return
    t = Table("", "QC pass", "QC reject", title=f"QC on {conf['good_passed'] + conf['good_rejected']} good and "
              f"{conf['broken_rejected'] + conf['broken_passed']} broken clips (seeds {conf['seeds']}, {conf['size']})")
    t.add_row("good", str(conf["good_passed"]), str(conf["good_rejected"]))
    t.add_row("broken", str(conf["broken_passed"]), str(conf["broken_rejected"]))
    out.print(t)
    out.print(f"broken caught: {conf['broken_caught']:.1%}   good falsely rejected: {conf['good_false_reject']:.1%}")
    out.print("caught per defect: " + ", ".join(f"{k} {v}" for k, v in conf["per_defect"].items()))
    for m in conf["misses"]:
        out.print(f"  miss: {m['clip']} -> {m['verdict']} {'; '.join(m['reasons'])}", markup=False, soft_wrap=True)
    out.print(f"boiling set (seeds {boil['seeds']}, held out): good {boil['good_passed']} passed, {boil['good_rejected']} "
              f"rejected ({boil['good_false_reject']:.1%}); boiling {boil['boiling_caught']} caught, {boil['boiling_passed']} "
              f"passed ({boil['catch_rate']:.1%}); " + ", ".join(f"{k} {v}" for k, v in boil["per_kind"].items()))
    out.print(f"speed, {speed['clip']}: decode {speed['decode_s']} s + QC {speed['qc_s']} s = {speed['total_s']} s")


@click.command()
@click.argument("src", required=False, type=click.Path(dir_okay=False))
@click.argument("dst", required=False, type=click.Path(dir_okay=False))
@click.option("--fps", type=FiniteRange(1, 240), default=None, help="Output frame rate (any ratio to the input's).")
@click.option("--bench", is_flag=True, help="Measure instead: PSNR of interpolated frames against dropped ground truth, "
              "vs linear blending and frame repetition, and speed at 720p.")
@click.option("--json", "as_json", is_flag=True, help="With --bench: print JSON.")
def interpolate(src, dst, fps, bench, as_json):
    """Convert SRC to --fps N by optical-flow frame interpolation; write DST as H.264 MP4.

    DST has exactly round((n-1)*N/fps_in)+1 frames and starts on SRC's first frame. At a cut
    the nearest frame is repeated instead of blending two scenes. SRC's first audio track goes
    along, re-encoded as AAC, in step with the picture (the duration does not change); from a
    pipe, the video only.

    \b
    Example:
      clipmill interpolate clip24.mp4 clip60.mp4 --fps 60
      clipmill interpolate --bench
    """
    if bench:
        _interp_bench(as_json)
        return
    if not (src and dst and fps):
        raise click.UsageError("give SRC DST --fps N, or --bench")
    import av

    from clipmill.jobs.core.preflight import check_input_file
    from clipmill.pipeline.interpolate import interpolate as interp
    from clipmill.pipeline.audio import AudioError, read_sound
    from clipmill.pipeline.video import VideoError, decode, encode_h264

    with domain_errors():
        check_input_file(src, "SRC")
        _check_dst(src, dst)
    try:
        frames, fps_in = decode(src, min_frames=2)
    except VideoError as e:
        raise BadInput(f"SRC {str(e)}")
    if fps_in <= 0:
        raise BadInput(f"SRC {src}: the file states no frame rate")
    if frames.shape[1] % 2 or frames.shape[2] % 2:
        raise BadInput(f"SRC {src}: {frames.shape[2]}x{frames.shape[1]} has an odd side; H.264 yuv420p needs even sides")
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    seekable = Path(src).is_file()  # a pipe's frames are read once: its sound cannot be read again
    if not seekable:
        err.print(f"{src}: not a regular file (a pipe); its audio, if any, is not carried over")
    t0 = time.perf_counter()
    with Progress(TextColumn("interpolate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err) as p:
        task = p.add_task("", total=None)
        out_frames = interp(frames, fps_in, fps, progress=lambda d, t: p.update(task, completed=d, total=t))
    sound = None
    if seekable:
        try:
            sound = read_sound(src, len(out_frames) / fps)
        except (AudioError, VideoError) as e:
            err.print(f"SRC {e}; DST has the video only")
        if sound is not None and sound.damaged:
            err.print(f"SRC {src}: {sound.damaged} damaged audio packet{'s' if sound.damaged != 1 else ''} (not "
                      "decodable, or not sound); DST's sound is silent there")
    try:
        encode_h264(out_frames, fps, dst, sound=sound)
    except (OSError, av.error.FFmpegError) as e:  # a full disk, a folder gone or made read-only meanwhile
        raise SetupError(f"DST {dst}: cannot be written ({e.strerror or e})") from None
    secs = time.perf_counter() - t0
    err.print(f"{src}: {len(frames)} frames at {fps_in:g} fps -> {dst}: {len(out_frames)} frames at {fps:g} fps "
              f"({len(out_frames) / secs:.1f} frames/s)")


OUT_EXTENSIONS = (".mp4",)  # what encode_h264 writes: H.264 in an MP4 container


def _check_dst(src: str, dst: str) -> None:
    """DST must be a new or existing .mp4 file in a folder that exists and is not SRC itself."""
    import os

    p = Path(dst)
    if p.suffix.lower() not in OUT_EXTENSIONS:
        raise BadInput(f"DST {dst}: unknown output extension {p.suffix or '(none)'!r}; allowed: "
                       f"{', '.join(OUT_EXTENSIONS)} (H.264 in MP4)")
    if p.is_dir():
        raise BadInput(f"DST {dst}: is a folder; give a file name such as {p / 'out.mp4'}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise BadInput(f"DST {dst}: the folder {parent} does not exist; create it first")
    if p.exists() and os.path.samefile(src, p) or Path(src).resolve() == p.resolve():
        raise BadInput(f"DST {dst}: is SRC itself; write to another file (SRC would be overwritten)")
    if not os.access(parent, os.W_OK):
        raise BadInput(f"DST {dst}: the folder {parent} is not writable")


def _interp_bench(as_json: bool) -> None:
    from rich.table import Table

    from clipmill.pipeline.interp_eval import evaluate, speed_720p

    with err.status("interpolating dropped frames of smooth 120 fps sequences..."):
        res = evaluate()
    with err.status("speed at 720p..."):
        speed = speed_720p()
    if as_json:
        click.echo(json.dumps({"quality": res, "speed": speed}))
        return
    t = Table("case", "in -> out fps", "new frames", "PSNR flow", "linear", "repeat", "gain vs linear", "gain vs repeat",
              title=f"interpolated vs dropped frames ({res['size']})")
    for r in res["rows"]:
        t.add_row(r["case"], f"{r['fps_in']} -> {r['fps_out']}", str(r["new_frames"]), f"{r['psnr_flow']:.2f}",
                  f"{r['psnr_linear']:.2f}", f"{r['psnr_repeat']:.2f}", f"{r['gain_vs_linear']:+.2f} dB",
                  f"{r['gain_vs_repeat']:+.2f} dB")
    out.print(t)
    out.print(f"mean gain: {res['mean_gain_vs_linear']:+.2f} dB over linear blending, "
              f"{res['mean_gain_vs_repeat']:+.2f} dB over frame repetition")
    out.print(f"speed, {speed['clip']}: {speed['seconds']} s, {speed['output_fps']} output frames/s")
