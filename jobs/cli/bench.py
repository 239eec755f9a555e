"""The speed ladder: clipmill bench."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from clipmill.jobs.cli.common import BadInput, default_device, domain_errors, err, out, qc_config_options
from clipmill.pipeline.models import SHAPES, ModelError


@click.command("bench")
@click.option("--model", default=SHAPES, show_default=True,
              help="'shapes' (built in), 'tiny', 'tiny-wan' or a local diffusers model folder.")
@click.option("--arch", type=click.Choice(["sd15"]), default=None,
              help="Instead of --model: build this full-size architecture with random weights (GPU figures "
                   "without a download; about 38 s per UNet call on a 2-core CPU).")
@click.option("--size", default=None, help="WIDTHxHEIGHT or N [default: 128 for tiny models, else the model's default size, 512 for --arch sd15].")
@click.option("--frames", type=int, default=None, help="Frames per clip [default: the model's].")
@click.option("--guidance", type=float, default=1.0, show_default=True,
              help="Guidance of rows 1-7 (1.0: off, as distilled models run; row 0 always uses CFG, 7.5, or 5.0 on Wan).")
@click.option("--clips", type=click.IntRange(4, 16), default=4, show_default=True, help="Clips per row (row 0 renders one).")
@click.option("--repeat", type=click.IntRange(1, 10), default=3, show_default=True,
              help="Rounds over all rows, interleaved; each row reports its fastest round (and all of them).")
@click.option("--compile", "compile_how", type=click.Choice(["torch", "tensorrt"]), default="torch", show_default=True,
              help="What row 7 compiles with (GPU only; elsewhere row 7 says why and runs uncompiled).")
@click.option("--device", default=None, help="cpu, cuda or cuda:N [default: cuda if available].")
@click.option("--prompts", type=click.Choice(["auto", "shapes", "ads"]), default="auto", show_default=True,
              help="shapes: prompts of the shapes world, with the quality columns (adherence per attribute, "
                   "distances to row 0, PSNR against the twin); ads: the ad prompts, speed only; auto: shapes "
                   "for a model of the shapes world.")
@click.option("--quality-clips", type=click.IntRange(0, 2000), default=None,
              help="Clips per row for the quality columns (same prompts and seeds in every row; half held out; "
                   "0 turns them off; --seams takes 0 as 12) [default: 32; --failures 40; --adherence 200; --seams 12].")
@click.option("--failures", is_flag=True,
              help="Instead of the ladder: render --quality-clips shapes-world prompts well and broken as real models "
                   "break (1-2 steps, guidance 12/16, a feature cache far too coarse, NaN latents mid-denoise, "
                   "the wrong VAE scaling) and report the post stage's catch rate on each (QC, and the render check "
                   "of the decode where the model folder states its limits).")
@click.option("--adherence", is_flag=True,
              help="Instead of the ladder (a shapes-world model only, at its own size and frames): adherence per "
                   "attribute of its teacher at 50, 8 and 6 DDIM steps and its student at both tiers on "
                   "--quality-clips prompts, rendered once (the model's own) and with run's default draws (what a "
                   "batch delivers: see README, Draws), and QC's pass rate.")
@click.option("--assembly", is_flag=True,
              help="Instead of the ladder: the seconds to assemble one 15 s 720x1280 ad (examples/ad/speed-15s.toml: "
                   "3 shots, 3 texts, logo, end card, music) from rendered footage, CPU and wall, median of --repeat.")
@click.option("--delivery", is_flag=True,
              help="Instead of the ladder: what each ad delivery setting (CRF, bitrate cap, profile) keeps of the "
                   "frames before encoding (PSNR, SSIM) and the file size it makes, on 5 s of 720x1280 footage.")
@click.option("--seams", is_flag=True,
              help="Instead of the ladder: long shots (one render over FreeNoise windows) against independent windows "
                   "glued together, on --quality-clips held-out shapes prompts: cuts QC finds at the joins and the "
                   "compensated SSIM there over the clip's median.")
@click.option("--review", is_flag=True,
              help="Instead of the ladder: the review page at scale: a synthetic --jobs batch in headless Chromium "
                   "(first paint, interactive, page bytes, media requests on load, j across a page) and the server's "
                   "time per page with --table-jobs jobs in the table, on SQLite and on --pg.")
@click.option("--jobs", "review_jobs", type=click.IntRange(100, 100_000), default=5000, show_default=True,
              help="--review: jobs in the batch opened.")
@click.option("--table-jobs", type=click.IntRange(100, 1_000_000), default=100_000, show_default=True,
              help="--review: jobs in the whole table (the batch and other batches).")
@click.option("--pg", "pg_url", envvar="CLIPMILL_BENCH_PG_URL", default=None, metavar="URL",
              help="--review: also time pages on this PostgreSQL (a schema of its own, dropped afterwards).")
@click.option("--preview", is_flag=True,
              help="Instead of the ladder: the streaming preview on the shapes model: time to first frame, frames per "
                   "second per tier, frame-time stability (fixed steps against the adaptive scheduler) while a second "
                   "process takes a core for 10 s of a 40 s stream, and the stream's seams against a whole clip.")
@qc_config_options
@click.option("--json", "as_json", is_flag=True, help="Print the whole result as JSON.")
def bench_cmd(model, arch, size, frames, guidance, clips, repeat, compile_how, device, prompts, quality_clips, failures,
              adherence, assembly, delivery, seams, review, review_jobs, table_jobs, pg_url, preview, qc_cfg, as_json):
    """Measure the speed ladder: 50-step baseline to distilled, cached, batched rendering.

    Every row is measured side by side in this one run: seconds per clip (render and end to
    end, with interpolation, H.264 and QC), speed-up over row 0, PSNR against the row it adds a
    layer to, peak memory, and the denoiser evaluations, K/V projections and blocks each row did
    or skipped. Absolute seconds mean something only on a GPU; on a CPU read the ratios.

    On prompts of the shapes world (the shapes model's default) each row also gets quality
    columns: adherence per attribute as the world's analyzer reads it, the distance of what it
    draws to row 0's clips on the same prompts, and PSNR against its twin row. Row 0 is the
    model's undistilled teacher at 50 steps when its folder ships one.

    \b
    Example:
      clipmill bench --adherence
      clipmill bench --assembly
      clipmill bench --delivery
      clipmill bench --seams --quality-clips 12
      clipmill bench --review --pg postgresql+psycopg://127.0.0.1/test
      clipmill bench --preview
      clipmill bench --model tiny --json
      clipmill bench --model tiny --size 64 --frames 8 --prompts shapes --quality-clips 8 --clips 4 --repeat 1
      clipmill bench --model tiny --size 64 --frames 8 --failures --quality-clips 4
      clipmill bench --arch sd15 --device cuda --size 512 --frames 16
    """
    from rich.table import Table

    if assembly or delivery or seams:
        _ads_bench(assembly, delivery, seams, repeat, quality_clips, as_json)
        return
    if review:
        _review_bench(review_jobs, table_jobs, pg_url, as_json)
        return
    if preview:
        _preview_bench(as_json)
        return
    from clipmill.jobs.bench.ladder import bench
    from clipmill.pipeline.shapes import ATTRIBUTES
    from clipmill.jobs.core.prompts import parse_size
    from clipmill.pipeline.models import arch_path, model_info

    from clipmill.jobs.core.preflight import check_device

    with domain_errors():  # before building a full-size architecture
        device = check_device(device or default_device())
    try:
        info = model_info(str(arch_path(arch)) if arch else model)
        if arch:
            info = replace(info, name=f"arch:{arch}")
        size_t = (128, 128) if size is None and info.is_tiny else info.default_size
        if size is not None:
            size_t, msg = parse_size(size, info)
            if msg:
                raise click.BadParameter(f"{size!r} {msg}", param_hint="--size")
        n_frames = info.default_frames if frames is None else frames
        if msg := info.check_frames(n_frames):
            raise click.BadParameter(f"{n_frames}: {msg}", param_hint="--frames")
        if adherence and failures:
            raise click.UsageError("give --adherence or --failures, not both")
        if quality_clips == 1 or (quality_clips == 0 and (adherence or failures)):
            raise click.BadParameter(f"{quality_clips}: the distances need at least 2 clips per row"
                                     + ("" if quality_clips else "; 0 turns the ladder's quality columns off"),
                                     param_hint="--quality-clips")
        if adherence:
            _adherence(info, device, quality_clips or 200, qc_cfg, as_json)
            return
        if failures:
            _failures(info, size_t, n_frames, device, quality_clips or 40, qc_cfg, as_json)
            return
        if quality_clips is None:
            quality_clips = 32
        result = bench(info, size_t, n_frames, guidance, device, compile_how, clips, repeat,
                       progress=None if as_json else (lambda m: err.print(f"[dim]{m}[/]")), prompts=prompts,
                       quality_clips=quality_clips)
    except (ModelError, ValueError) as e:
        raise BadInput(str(e))
    if as_json:
        click.echo(json.dumps(result))
        return
    t = Table("row", "what", "evals/clip", "render s/clip", "end-to-end s/clip", "speed-up", "e2e speed-up",
              "PSNR vs twin", "peak MiB", "skipped", title=f"{result['model']} ({result['family']}), {result['size'][0]}x"
              f"{result['size'][1]}, {result['frames']} frames, {result['device']}")
    for r in result["rows"]:
        w = r["work"]
        skipped = ", ".join(f"{k} {v}" for k, v in w.items() if k in ("kv_rows_avoided", "blocks_skipped", "cached_steps") and v)
        p = "" if r["twin"] is None else ("identical" if r["psnr_vs_twin_db"] is None else f"{r['psnr_vs_twin_db']} dB")
        t.add_row(r["row"], r["name"] + (f" [dim]({r['note']})[/]" if r["note"] else ""), f"{r['denoiser_evaluations_per_clip']:g}",
                  f"{r['render_s_per_clip']:.3f}", f"{r['end_to_end_s_per_clip']:.3f}", f"{r['speedup_render']:.1f}x",
                  f"{r['speedup_end_to_end']:.1f}x", p, f"{r['peak_memory_mib']:.0f}", skipped)
    out.print(t)
    if any("quality" in r for r in result["rows"]):
        q = Table("row", *ATTRIBUTES, "held-out (c/s/m/b/k)", "words vs row 0 (max TVD)", "Fréchet vs row 0",
                  "PSNR vs twin", title=f"quality: adherence on {result['quality_clips']} shapes-world clips per row "
                                        "(same prompts and seeds in every row)")
        for r in result["rows"]:
            qq = r["quality"]
            p = ("" if r["twin"] is None else "identical" if qq["identical_to_twin"] else f"{qq['psnr_vs_twin_db']} dB")
            q.add_row(r["row"], *(f"{qq['adherence'][k]:.0%}" for k in ATTRIBUTES),
                      "/".join(f"{qq['adherence_heldout'][k] * 100:.0f}" for k in ATTRIBUTES),
                      "" if qq["read_distance_vs_row0"] is None else f"{max(qq['read_distance_vs_row0'].values()):.2f}",
                      "" if qq["frechet_vs_row0"] is None else f"{qq['frechet_vs_row0']:.4f}", p)
        out.print(q)
    out.print(f"best: row {result['best_row']}, {result['best_speedup_render']}x render, "
              f"{result['best_speedup_end_to_end']}x end to end ({result['seconds']} s in all)")
    for g in result["guidance_modes"]:
        p = "reference" if g["psnr_vs_cfg_db"] is None and g["mode"] == "cfg" else f"{g['psnr_vs_cfg_db']} dB vs CFG"
        out.print(f"guidance {g['mode']} {g['guidance']:g}: {g['render_s_per_clip']:.3f} s/clip, "
                  f"{g['denoiser_evaluations_per_clip']:g} evals/clip, {p}")
    for d in result["decoders"]:
        out.print(f"decoder {d['decoder']}: {d['decode_s_per_clip']:.3f} s/clip"
                  + ("" if d["psnr_vs_vae_db"] is None else f", {d['psnr_vs_vae_db']} dB vs the VAE"))


def _failures(info, size, frames, device, clips, qc_cfg, as_json) -> None:
    from rich.table import Table

    from clipmill.jobs.bench.failures import failures

    result = failures(info, clips, size, frames, device=device, qc=qc_cfg,
                      progress=None if as_json else (lambda m: err.print(f"[dim]{m}[/]")))
    if as_json:
        click.echo(json.dumps(result))
        return
    t = Table("kind", "what", "QC", "top reasons", "adherence c/s/m/b/k", "PSNR vs good",
              title=f"QC on {result['clips']} renders per kind, {info.name}, {size[0]}x{size[1]}, {frames} frames -> "
                    f"{result['fps_out']} fps")
    for k in result["kinds"]:
        qc = (f"passed {1 - k['reject_rate']:.0%}" if k["kind"] == "good" else f"caught {k['reject_rate']:.0%}")
        reasons = ", ".join(f"{r} {n}" for r, n in list(k["reasons"].items())[:3])
        t.add_row(k["kind"], k["what"], qc, reasons, "/".join(f"{v * 100:.0f}" for v in k["adherence"].values()),
                  "" if k["psnr_vs_good_db"] is None else f"{k['psnr_vs_good_db']} dB")
    out.print(t)


def _adherence(info, device, clips, qc_cfg, as_json) -> None:
    from rich.table import Table

    from clipmill.jobs.bench.adherence import adherence_table, motion_by_asked
    from clipmill.pipeline.shapes import ATTRIBUTES

    result = adherence_table(info, clips, device=device, qc=qc_cfg,
                             progress=None if as_json else (lambda m: err.print(f"[dim]{m}[/]")))
    if as_json:
        click.echo(json.dumps(result))
        return
    t = Table("row", *ATTRIBUTES, "all 5", "held-out c/s/m/b/k", "train c/s/m/b/k",
              "motion right: left right up down still", "2nd reader c/s/m/b/k all 5", "QC passed", "renders/clip",
              "s/clip",
              title=f"adherence on {result['clips']} shapes prompts ({result['heldout_clips']} held out), {info.name}")
    for r in result["rows"]:
        t.add_row(r["row"], *(f"{r['adherence'][k]:.1%}" for k in ATTRIBUTES), f"{r['all_right']:.1%}",
                  "/".join(f"{r['adherence_heldout'][k] * 100:.0f}" for k in ATTRIBUTES),
                  "/".join(f"{r['adherence_train'][k] * 100:.0f}" for k in ATTRIBUTES),
                  motion_by_asked(r["motion_confusion"]),
                  "/".join(f"{r['second_reader'][k] * 100:.0f}" for k in (*ATTRIBUTES, "all")),
                  "" if "qc_passed" not in r else f"{r['qc_passed']:.1%}", f"{r['renders_per_clip']:.2f}",
                  f"{r['render_s_per_clip']:.3f}")
    out.print(t)



def _preview_bench(as_json: bool) -> None:
    from rich.table import Table

    from clipmill.jobs.bench.preview import preview_bench

    res = preview_bench()
    if as_json:
        click.echo(json.dumps(res))
        return
    out.print(f"time to first frame {res['first_frame_ms']} ms (warm model); frames per second: "
              + ", ".join(f"{k} {v}" for k, v in res["fps"].items()), soft_wrap=True, markup=False, highlight=False)
    t = Table("steps", "P50 ms", "P95 ms", "std ms", "tier switches", "dropped", "analyzer (colour/shape/bg) per tier",
              title=f"paced to {res['budget_ms']} ms a frame, a second process on a core for 10 s of 40 s")
    for name in ("fixed", "adaptive"):
        r = res[name]
        reads = "; ".join(f"{k} {'/'.join(str(round(v * 100)) for v in a.values())}" for k, a in r["adherence_by_tier"].items())
        t.add_row(name, str(r["p50_ms"]), str(r["p95_ms"]), str(r["std_ms"]),
                  ", ".join(f"{a}->{b}" for a, b in r["switches"]) or "none", str(r["dropped"]), reads)
    out.print(t)
    s = res["seams"]
    out.print(f"std ratio fixed/adaptive {res['std_ratio']}x; adaptive P95 {res['p95_over_budget']:+.1%} of the budget; "
              f"seams: stream pair SSIM median {s['stream_pair_ssim_median']} (min {s['stream_pair_ssim_min']}) against "
              f"a whole clip's {s['clip_pair_ssim_median']} (min {s['clip_pair_ssim_min']}); QC finds "
              f"{s['cuts_in_stream']} cut(s) in {s['stream_frames']} stream frames", soft_wrap=True, markup=False,
              highlight=False)


def _review_bench(jobs: int, table_jobs: int, pg_url: str | None, as_json: bool) -> None:
    from rich.table import Table

    from clipmill.jobs.bench.review import review_bench

    if table_jobs < jobs:
        raise click.BadParameter(f"{table_jobs}: the table holds the batch, so at least --jobs ({jobs})",
                                 param_hint="--table-jobs")
    res = review_bench(jobs, table_jobs, pg_url)
    if as_json:
        click.echo(json.dumps(res))
        return
    b = res["browser"]
    if "skipped" in b:
        out.print(f"browser: skipped ({b['skipped']})")
    else:
        out.print(f"a {jobs}-job batch in headless Chromium: first paint {b['first_paint_ms']} ms, interactive "
                  f"{b['interactive_ms']} ms, page {b['page_bytes']:,} bytes ({b['cards']} cards), {b['media_requests']} "
                  f"media requests on load, j across a page boundary: {'yes' if b.get('j_to_page_2') else 'NO'}",
                  soft_wrap=True, markup=False, highlight=False)
    t = Table("page", "SQLite ms", *(["PostgreSQL ms"] if "postgresql_ms" in res else []),
              title=f"server time per page, {table_jobs:,} jobs in the table (median of 5)")
    for name, ms in res["sqlite_ms"].items():
        t.add_row(name, f"{ms:.1f}", *([f"{res['postgresql_ms'][name]:.1f}"] if "postgresql_ms" in res else []))
    out.print(t)


def _ads_bench(assembly: bool, delivery: bool, seams: bool, repeat: int, quality_clips, as_json: bool) -> None:
    """``--assembly`` (ad assembly speed), ``--delivery`` (delivery settings' quality and size)
    or ``--seams`` (long shots against glued windows)."""
    from rich.table import Table

    from clipmill.jobs.bench.ads import assembly_speed, delivery_quality, seams as seam_table

    if seams:
        res = seam_table(quality_clips or 12)
        if as_json:
            click.echo(json.dumps(res, ensure_ascii=False))
            return
        t = Table("render", "clips", "with a cut", "joins read as cuts", "min join SSIM / median", "mean",
                  "clips within 10%", title=f"{res['frames']} frames, windows of {res['window']}")
        for name, r in res["summary"].items():
            t.add_row("one long shot (FreeNoise)" if name == "long" else "independent windows glued", str(r["clips"]),
                      str(r["with_a_cut"]), str(r["joins_read_as_cuts"]), f"{r['min_join_ratio']:.3f}",
                      f"{r['mean_join_ratio']:.3f}", str(r["within_10pct"]))
        out.print(t)
        return

    if assembly:
        res = assembly_speed(repeat)
        if as_json:
            click.echo(json.dumps(res, ensure_ascii=False))
            return
        m = res["median"]
        out.print(f"assembling one {res['seconds']:g} s {res['format']} ad ({res['frames']} frames; {res['template']}), "
                  f"median of {repeat}: {m['assembly_cpu_s']:.2f} s CPU for the assembly (layers {m['layers_s']:.2f} s + "
                  f"encode {m['encode_s']:.2f} s wall), {m['qc_cpu_s']:.2f} s CPU ({m['qc_s']:.2f} s wall) for its ad-level QC; "
                  f"{m['cpu_s']:.2f} s CPU "
                  f"and {m['wall_s']:.2f} s wall in all", soft_wrap=True, markup=False, highlight=False)
        return
    res = delivery_quality()
    if as_json:
        click.echo(json.dumps(res, ensure_ascii=False))
        return
    t = Table("setting", "PSNR (dB)", "SSIM", "bytes", "kbit/s", "encode s", title=res["footage"])
    for r in res["rows"]:
        t.add_row(r["setting"], f"{r['psnr_db']:.2f}", f"{r['ssim']:.4f}", f"{r['bytes']:,}", str(r["kbps"]),
                  f"{r['encode_s']:.2f}")
    out.print(t)
