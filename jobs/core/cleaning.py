"""Prompt cleaning: normalise text, pull out subject / action / scene / camera, and put them back
together in one canonical order. English and Chinese both work.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# Canonical camera moves and the phrases (English and Chinese) that name them. Matching is
# case-insensitive and takes the longest phrase first, so "dolly in" wins over "dolly".
CAMERA_TERMS: dict[str, tuple[str, ...]] = {
    "static shot": ("static shot", "static camera", "static", "fixed camera", "locked-off shot", "locked off",
                    "固定镜头", "静止镜头", "固定机位"),
    "pan left": ("pan left", "panning left", "左摇", "向左摇"),
    "pan right": ("pan right", "panning right", "右摇", "向右摇"),
    "pan": ("pan shot", "panning shot", "panning", "pan", "摇镜头", "摇镜", "横摇"),
    "tilt up": ("tilt up", "tilting up", "上摇"),
    "tilt down": ("tilt down", "tilting down", "下摇"),
    "tilt": ("tilt shot", "tilting", "tilt", "俯仰镜头"),
    "dolly in": ("dolly in", "dolly-in", "push in", "push-in", "pushing in", "推镜头", "推镜", "推进", "推近"),
    "dolly out": ("dolly out", "dolly-out", "pull out", "pull-out", "pull back", "pulling back",
                  "拉镜头", "拉镜", "拉远", "后拉"),
    "dolly": ("dolly shot", "dolly", "移镜头", "移镜"),
    "tracking shot": ("tracking shot", "tracking", "follow shot", "following shot", "跟拍", "跟镜头", "跟随镜头"),
    "orbit": ("orbit shot", "orbiting", "orbit", "arc shot", "360 shot", "环绕镜头", "环绕拍摄", "环绕", "环拍"),
    "zoom in": ("zoom in", "zooming in", "zoom-in", "放大", "变焦推进"),
    "zoom out": ("zoom out", "zooming out", "zoom-out", "缩小", "变焦拉远"),
    "zoom": ("zoom shot", "zoom", "变焦"),
    "crane up": ("crane up", "boom up", "升镜头", "上升镜头"),
    "crane down": ("crane down", "boom down", "降镜头", "下降镜头"),
    "crane shot": ("crane shot", "crane", "jib shot", "升降镜头", "摇臂镜头"),
    "handheld": ("handheld camera", "handheld shot", "handheld", "hand-held", "手持镜头", "手持拍摄", "手持"),
    "aerial shot": ("aerial shot", "aerial view", "aerial", "drone shot", "航拍", "无人机拍摄"),
    "close-up": ("extreme close-up", "close-up shot", "close-up", "close up", "closeup", "大特写", "特写镜头",
                 "特写", "近景"),
    "medium shot": ("medium shot", "mid shot", "中景"),
    "wide shot": ("wide shot", "wide angle shot", "wide-angle shot", "establishing shot", "long shot",
                  "全景", "远景", "广角镜头"),
    "top-down shot": ("top-down shot", "top-down", "top down", "overhead shot", "overhead", "bird's-eye view",
                      "birds-eye view", "bird's eye view", "俯拍", "俯视", "俯视镜头", "鸟瞰"),
    "low-angle shot": ("low-angle shot", "low angle shot", "low angle", "仰拍", "仰视", "仰角镜头"),
    "slow motion": ("slow motion", "slow-motion", "slow-mo", "慢动作", "慢镜头"),
}

# Phrases that also mean something else ("steak in a pan", "被鲜花环绕", "overhead lights"). In free
# text they count as camera moves only when they are a whole clause ("..., pan, ..."); in the
# camera column they always do.
AMBIGUOUS = frozenset(
    {"pan", "panning", "tilt", "tilting", "dolly", "zoom", "crane", "static", "tracking", "orbit", "orbiting",
     "aerial", "overhead", "handheld", "top down", "close up", "环绕", "推进", "推近", "放大", "缩小", "手持",
     "近景", "俯视", "仰视", "变焦", "鸟瞰", "后拉", "拉远", "中景", "全景", "远景", "慢镜头"}
)

_PHRASES = sorted(
    ((p.lower(), canon) for canon, ps in CAMERA_TERMS.items() for p in ps), key=lambda x: -len(x[0])
)
_SAFE_PHRASES = [(p, c) for p, c in _PHRASES if p not in AMBIGUOUS]


def _is_cjk(ch: str) -> bool:
    return "\u3400" <= ch <= "\u9fff" or "\uf900" <= ch <= "\ufaff" or "\u3040" <= ch <= "\u30ff"


def _phrase_regex(phrase: str) -> str:
    esc = re.escape(phrase)
    if _is_cjk(phrase[0]):
        return esc  # no word boundaries in CJK text
    return rf"(?<![\w-]){esc}(?![\w-])"


_CAMERA_RE = re.compile("|".join(f"({_phrase_regex(p)})" for p, _ in _SAFE_PHRASES), re.IGNORECASE)


def camera_canonical(text: str) -> str | None:
    """The canonical camera move for a camera phrase, or None if the phrase is not one."""
    key = normalize(text).lower().strip(" ,.;")
    key = re.sub(r"\s+", " ", key)
    for phrase, canon in _PHRASES:
        if key == phrase:
            return canon
    return None


def camera_vocabulary() -> str:
    """A short listing of the camera vocabulary, for error messages and help."""
    return ", ".join(CAMERA_TERMS)


# Punctuation folded to ASCII after NFKC (which already maps full-width ，；：！？（） etc.).
_PUNCT = str.maketrans(
    {
        "、": ",",
        "。": ".",
        "「": '"',
        "」": '"',
        "『": '"',
        "』": '"',
        "【": "(",
        "】": ")",
        "《": '"',
        "》": '"',
        "“": '"',
        "”": '"',
        "‘": "'",
        "’": "'",
        "–": "-",
        "—": "-",
        "―": "-",
        "·": " ",
        "・": " ",
    }
)


def normalize(text: str) -> str:
    """NFKC, control characters removed (those that are whitespace become spaces), punctuation
    folded, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text)
    text = "".join(  # whitespace controls (tab, form feed, NEL, the file separators) are spaces
        " " if ch.isspace() else ch
        for ch in text
        if ch.isspace() or unicodedata.category(ch) not in ("Cc", "Cf", "Co", "Cs")
    )
    text = text.translate(_PUNCT)
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"\s+([,.;:!?)])", r"\1", text)  # no space before closing punctuation
    text = re.sub(r"([(])\s+", r"\1", text)
    text = re.sub(r"([,;:!?])(?=[^\s\d,.;:!?)\"'])", r"\1 ", text)  # one space after separators
    text = re.sub(r"([,;])(\s*[,;])+", r"\1", text)  # ", ," -> ","
    text = re.sub(r"\.{4,}", "...", text)
    return text.strip(" ,;")


def _join(a: str, b: str) -> str:
    """Join two phrases with a space, or with none between CJK characters."""
    if not a:
        return b
    if not b:
        return a
    if _is_cjk(a[-1]) and _is_cjk(b[0]):
        return a + b
    return f"{a} {b}"


@dataclass(frozen=True)
class Elements:
    subject: str = ""
    action: str = ""
    scene: str = ""
    camera: str = ""  # canonical camera moves, comma-separated

    def canonical(self) -> str:
        """subject action, scene, camera: the one order every prompt is put back in."""
        head = _join(self.subject, self.action)
        return ", ".join(p for p in (head, self.scene, self.camera) if p)

    def as_dict(self) -> dict[str, str]:
        return {"subject": self.subject, "action": self.action, "scene": self.scene, "camera": self.camera}


# A clause that sets the scene: "in a noodle shop", "at night", "on a wooden table", "在老街面馆里".
_SCENE_RE = re.compile(
    r"^(in|inside|at|on|under|over|by|near|against|outside|within|amid|among|background)\b|^(在|于)",
    re.IGNORECASE,
)


_CUT = "\x00"  # where split_free_prompt took a camera phrase out
_EMPTY_PAIR_RE = re.compile(r"""[(\[{（【「『"“'‘]\s*\x00\s*[)\]}）】」』"”'’]""")


def split_free_prompt(text: str) -> Elements:
    """Pull the elements out of a free-text prompt.

    Camera phrases are found anywhere and mapped to canonical moves. Clauses (split on commas)
    that open with a place word form the scene. The rest is the subject and its action, kept in
    the user's word order: a free prompt does not say where the subject ends and the action starts.
    """
    cameras: list[str] = []

    def add(canon: str) -> None:
        if canon not in cameras:
            cameras.append(canon)

    def take(m: re.Match) -> str:
        add(_SAFE_PHRASES[m.lastindex - 1][1])
        return _CUT  # a mark (normalize leaves no control characters), so that only what it leaves is tidied

    kept = []
    for clause in re.split(r"[,;]", normalize(text)):
        canon = camera_canonical(clause)
        if canon is not None:
            add(canon)
        else:
            kept.append(clause)
    rest = _CAMERA_RE.sub(take, ",".join(kept))
    # what a camera phrase leaves: brackets or quotes around nothing ("a cat (close-up) eating",
    # "【特写】"), and an article and "of" around it ("a drone shot of a city")
    rest = _EMPTY_PAIR_RE.sub(_CUT, rest)
    rest = re.sub(rf"\b(a|an|the)\s*{_CUT}\s*of\s+", _CUT, rest, flags=re.IGNORECASE).replace(_CUT, ",")
    clauses = [c.strip(" .;:-") for c in re.split(r"[,;]", rest)]
    clauses = [re.sub(r"\s+(with|and|a|an|the)$", "", c, flags=re.IGNORECASE).strip() for c in clauses]
    clauses = [c for c in clauses if c]
    scene = [c for c in clauses if _SCENE_RE.match(c)]
    subject = [c for c in clauses if c not in scene]
    return Elements(subject=", ".join(subject), scene=", ".join(scene), camera=", ".join(cameras))


def clean_elements(subject: str, action: str, scene: str, camera: str) -> Elements:
    """Clean the four given elements; ``camera`` must name known camera moves (comma-separated)."""
    cams = []
    for part in re.split(r"[,;/]", normalize(camera)):
        if not part.strip():
            continue
        canon = camera_canonical(part)
        if canon is None:
            raise ValueError(part.strip())
        if canon not in cams:
            cams.append(canon)
    return Elements(
        subject=normalize(subject).strip(" ,."),
        action=normalize(action).strip(" ,."),
        scene=normalize(scene).strip(" ,."),
        camera=", ".join(cams),
    )
