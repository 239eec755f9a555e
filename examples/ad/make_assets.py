"""Makes the example ad template's logo (logo.png, with alpha) and music (music.m4a, AAC):
stand-ins drawn and synthesised here, so the example needs no outside files.

    .venv/bin/python examples/ad/make_assets.py
"""

from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw

from clipmill.pipeline.audio import RATE, tone

HERE = Path(__file__).parent


def logo(path: Path) -> None:
    img = Image.new("RGBA", (256, 256), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    d.ellipse((8, 8, 248, 248), fill=(230, 60, 40, 255), outline=(255, 255, 255, 255), width=10)
    d.polygon([(128, 52), (196, 180), (60, 180)], fill=(255, 255, 255, 255))
    img.save(path, optimize=True)


def music(path: Path, seconds: float = 12.0) -> None:
    pcm = tone(seconds, seed=7)
    with av.open(str(path), "w", format="mp4") as out:
        s = out.add_stream("aac", rate=RATE, layout="stereo")
        s.bit_rate = 96_000
        for i in range(0, pcm.shape[1], 1024):
            f = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm[:, i:i + 1024]), format="fltp", layout="stereo")
            f.sample_rate, f.pts = RATE, i
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode():
            out.mux(p)


if __name__ == "__main__":
    logo(HERE / "logo.png")
    music(HERE / "music.m4a")
    print("wrote", HERE / "logo.png", HERE / "music.m4a")
