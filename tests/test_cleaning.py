import pytest

from clipmill.jobs.core.cleaning import Elements, camera_canonical, clean_elements, normalize, split_free_prompt


@pytest.mark.parametrize(
    "raw, clean",
    [
        ("  a   bowl of\tramen \n", "a bowl of ramen"),
        ("ramen\u200b\x07 bowl", "ramen bowl"),  # zero-width and control characters go
        ("ＡＢＣ　ramen", "ABC ramen"),  # NFKC: full-width letters and space
        ("红烧肉，冒着热气。", "红烧肉, 冒着热气."),  # full-width and CJK punctuation folded
        ("a latte ,, in a cafe", "a latte, in a cafe"),
        ("“fresh” sushi — tonight", '"fresh" sushi - tonight'),
        ("a,b;c", "a, b; c"),
        ("price 3,50 euros", "price 3,50 euros"),  # digits keep their comma
    ],
)
def test_normalize(raw, clean):
    assert normalize(raw) == clean


@pytest.mark.parametrize(
    "phrase, canon",
    [
        ("Dolly In", "dolly in"),
        ("push in", "dolly in"),
        ("pull out", "dolly out"),
        ("推镜", "dolly in"),
        ("拉镜", "dolly out"),
        ("摇镜", "pan"),
        ("跟拍", "tracking shot"),
        ("环绕", "orbit"),
        ("特写", "close-up"),
        ("俯拍", "top-down shot"),
        ("close up", "close-up"),
        ("wide shot", "wide shot"),
        ("aerial", "aerial shot"),
        ("handheld", "handheld"),
        ("crane", "crane shot"),
        ("zoom in", "zoom in"),
        ("static", "static shot"),
        ("tilt up", "tilt up"),
        ("spinning wildly", None),
    ],
)
def test_camera_vocabulary(phrase, canon):
    assert camera_canonical(phrase) == canon


def test_free_prompt_puts_camera_last_and_scene_before_it():
    e = split_free_prompt("dolly in, Braised pork belly glistening, in a busy noodle shop")
    assert e == Elements(subject="Braised pork belly glistening", scene="in a busy noodle shop", camera="dolly in")
    assert e.canonical() == "Braised pork belly glistening, in a busy noodle shop, dolly in"


def test_free_prompt_chinese():
    e = split_free_prompt("推镜，红烧肉在砂锅里冒着热气，在老街面馆里，特写")
    assert e.subject == "红烧肉在砂锅里冒着热气"
    assert e.scene == "在老街面馆里"
    assert e.camera == "dolly in, close-up"
    assert e.canonical() == "红烧肉在砂锅里冒着热气, 在老街面馆里, dolly in, close-up"


def test_ambiguous_words_are_camera_moves_only_as_a_whole_clause():
    # "pan" the cooking vessel stays in the subject; ", pan," is a camera move
    e = split_free_prompt("a steak sizzling in a pan, pan")
    assert e.subject == "a steak sizzling in a pan"
    assert e.camera == "pan"
    assert split_free_prompt("蛋糕被鲜花环绕").camera == ""


def test_elements_canonical_order_and_cjk_joining():
    assert clean_elements("a latte", "being poured", "in a cafe", "Push In").canonical() == (
        "a latte being poured, in a cafe, dolly in"
    )
    assert clean_elements("红烧肉", "冒着热气", "在老街面馆", "推镜, 特写").canonical() == (
        "红烧肉冒着热气, 在老街面馆, dolly in, close-up"
    )


def test_elements_unknown_camera_raises_with_the_phrase():
    with pytest.raises(ValueError, match="^spinning wildly$"):
        clean_elements("a", "b", "c", "spinning wildly")


@pytest.mark.parametrize("raw,canonical", [
    ("a cat (close-up) eating fish", "a cat, eating fish, close-up"),
    ("【特写】一只猫在厨房吃鱼", "一只猫在厨房吃鱼, close-up"),
    ('a chef "zooming in" on ramen', "a chef, on ramen, zoom in"),
    ("[close-up] a cat eats [fish]", "a cat eats [fish], close-up"),  # the user's own brackets stay
    ("a drone shot of a city at night", "a city at night, aerial shot"),
    ("cats' toys, 'fresh' fish, close-up", "cats' toys, 'fresh' fish, close-up"),  # quotes not around a camera move
])
def test_a_camera_phrase_taken_out_leaves_no_empty_brackets_quotes_or_dangling_article(raw, canonical):
    assert split_free_prompt(raw).canonical() == canonical
