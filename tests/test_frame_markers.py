"""Frame markers (pipeline.frame_markers): one prompt per frame, its last token the frame's place
in the clip. The marked rows, the markers' spread over any clip length, a model folder's key,
and that the embeddings trained with the teacher encode in the written text encoder exactly what
the renderer then computes from it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from clipmill.pipeline import frame_markers, models
from clipmill.pipeline.train import nets
from clipmill.pipeline.train.stages import MarkerEmbeddings, TextCache, tokenize, uncond_rows


def test_each_frame_gets_its_marker_in_the_last_position_and_the_rest_is_the_prompt():
    ids = torch.tensor([[512, 10, 11, 513, 513, 513], [512, 20, 513, 513, 513, 513]])
    rows = frame_markers.mark(ids, 8, (1, 2, 3, 4, 5, 6, 7, 8), on=[True, False])
    assert rows.shape == (16, 6)
    assert rows[:8, -1].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert (rows[:8, :-1] == ids[0, :-1]).all()
    assert (rows[8:] == ids[1]).all()  # a clip without markers keeps its plain prompt in every frame


def test_markers_span_the_clip_whatever_its_length():
    assert frame_markers.frame_indices(8, 8).tolist() == list(range(8))
    assert frame_markers.frame_indices(16, 8).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert frame_markers.frame_indices(40, 8)[[0, -1]].tolist() == [0, 7]
    with pytest.raises(ValueError, match="frame=8 is outside a clip of 8 frames"):
        frame_markers.marker_index(8, 8, 8)


def test_per_frame_keeps_per_frame_states_and_repeats_per_clip_ones():
    per_clip = torch.arange(2.0).view(2, 1, 1)
    assert frame_markers.per_frame(per_clip, 2, 3).flatten().tolist() == [0, 0, 0, 1, 1, 1]
    rows = torch.arange(6.0).view(6, 1, 1)
    assert frame_markers.per_frame(rows, 2, 3) is rows
    with pytest.raises(ValueError, match="5 rows of text states for 2 clips of 3 frames"):
        frame_markers.per_frame(torch.zeros(5, 1, 1), 2, 3)
    one = torch.arange(3.0).view(3, 1, 1)  # one clip's per-frame empty caption, for two clips
    assert uncond_rows(one, 2, 3).flatten().tolist() == [0, 1, 2, 0, 1, 2]
    assert uncond_rows(torch.ones(1, 1, 1), 2, 3).shape == (6, 1, 1)


@pytest.mark.parametrize("value", [[1], [1, 1], "1,2", [1, -2], [1, True], list(range(65))])
def test_a_model_folder_with_bad_frame_markers_is_refused_naming_them(tmp_path, value):
    folder = tmp_path / "m"
    shutil.copytree(models.shapes_path(), folder, ignore=shutil.ignore_patterns("teacher"))
    meta = json.loads((folder / "clipmill.json").read_text())
    meta.pop("teacher", None)
    meta["frame_markers"] = value
    (folder / "clipmill.json").write_text(json.dumps(meta))
    with pytest.raises(models.ModelError) as e:
        models.model_info(str(folder))
    assert str(e.value) == (f"{folder / 'clipmill.json'}: frame_markers={value!r}: must be a list of 2 to 64 distinct "
                            "token ids (integers >= 0)")


def test_trained_marker_embeddings_encode_in_the_written_encoder_what_they_encoded_in_training():
    torch.manual_seed(0)
    te, tok = nets.build_text_encoder().eval(), nets.build_tokenizer()
    markers = MarkerEmbeddings.for_encoder(te, 8)
    caps = ["a red circle moves up on a black background, static shot", ""]
    with torch.no_grad():
        trained = markers.states(te, tok, caps, 8, [True, False])
    written = markers.write_into(te)
    assert not torch.equal(written.get_input_embeddings().weight, te.get_input_embeddings().weight)
    cache = TextCache(written, tok, markers.ids)
    assert torch.allclose(cache.frames(caps, 8, [True, False]), trained, atol=1e-6)
    # the positions before the marker are the prompt's own states (the encoder is causal)
    with torch.no_grad():
        plain = te(tokenize(tok, caps[:1]))[0][0]
    assert torch.allclose(trained[:8, :-1], plain[:-1].expand(8, -1, -1), atol=1e-5)
    assert not torch.allclose(trained[0, -1], trained[7, -1], atol=1e-3)  # frames differ at the marker
    assert torch.allclose(trained[8:], cache([""]).expand(8, -1, -1), atol=1e-6)
    # gradients reach the markers and nothing else
    te.requires_grad_(False)
    out = markers.states(te, tok, caps[:1], 8, [True])
    (out * torch.randn_like(out)).sum().backward()
    assert markers.weight.grad is not None and markers.weight.grad.abs().sum() > 0
