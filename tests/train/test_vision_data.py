"""Rendered-text data of the tiny VLM (issue 27): renders are whole 42-pixel tokens, deterministic in their seed
and drawn from the split they are given; the loss mask covers exactly the answer; CER against hand cases."""

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from deepseek_v41.model.image_processor import TokenType, pixels_to_patches
from deepseek_v41.train.data import write_documents
from deepseek_v41.train.vision_data import (
    PROMPT,
    TOKEN_PIXELS,
    build_example,
    char_accuracy,
    collate,
    corpus_lines,
    edit_distance,
    find_fonts,
    make_example,
    pick_snippet,
    render_sample,
    render_text,
)
from deepseek_v41.train.vlm import tiny_vision_config

MODEL = Path(__file__).parents[2] / "checkpoints" / "v41-tiny-chat"
IMAGE_ID = 8190
EOS = "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A corpus folder whose splits share no word: train words are Latin, held-out words Greek letter names."""
    folder = tmp_path_factory.mktemp("corpus")
    write_documents(folder / "train.txt", ["alpha beta gamma delta\nepsilon zeta eta theta", "iota kappa lambda"])
    write_documents(folder / "heldout.txt", ["Aleph Bet Gimel Dalet\nHe Vav Zayin", "Het Tet Yod"])
    return folder


def test_corpus_lines_keep_renderable_words_only(tmp_path):
    write_documents(tmp_path / "t.txt", ["def f(x): return x  # \u00e9t\u00e9\n\n   \n***\nplain words, here."])
    assert corpus_lines(tmp_path / "t.txt") == ["def f(x): return x", "plain words, here."]


@pytest.mark.parametrize("fonts", ["installed", "none"])
def test_renders_are_whole_tokens_and_deterministic(fonts):
    font_list = find_fonts() if fonts == "installed" else []
    lines = ["the quick brown fox", "jumps over the lazy dog", "x"]
    cfg = tiny_vision_config()
    for seed in range(12):
        text, image, font, _ = render_sample(lines, [3, seed], font_list)
        assert image.mode == "RGB" and image.width % TOKEN_PIXELS == 0 and image.height % TOKEN_PIXELS == 0
        assert image.width * image.height >= cfg.min_pixels and image.height in (42, 84)
        assert len(text) <= 24 and text in " ".join(lines)
        again = render_sample(lines, [3, seed], font_list)
        assert again[0] == text and again[2] == font and again[1].tobytes() == image.tobytes()
    assert render_sample(lines, [3, 0], font_list)[1].tobytes() != render_sample(lines, [3, 1], font_list)[1].tobytes()
    if fonts == "none":
        assert render_sample(lines, [3, 0], [])[2] == "pillow-default"


def test_renders_are_not_resized_or_padded(tok):
    """The processor's patches are exactly the render's pixels, normalised: no resize, no letterbox."""
    cfg = tiny_vision_config()
    _, image, _, _ = render_sample(["Resize nothing please"], [0, 7], find_fonts())
    example = build_example("Resize nothing please", image, tok, cfg, IMAGE_ID)
    g = example.image.grid
    assert (g.height, g.width) == (image.height, image.width)
    assert (g.n_llm_h, g.n_llm_w) == (image.height // 42, image.width // 42)
    pixels = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
    import torch

    expected = pixels_to_patches((torch.from_numpy(pixels) - 0.5) / 0.5, 14)
    assert torch.allclose(example.image.patches, expected, atol=1e-6)
    from PIL import Image

    with pytest.raises(ValueError, match="multiples of 42"):
        build_example("x", Image.new("RGB", (100, 42)), tok, cfg, IMAGE_ID)


def test_text_comes_from_the_split_given(corpus, tok):
    train, heldout = corpus_lines(corpus / "train.txt"), corpus_lines(corpus / "heldout.txt")
    train_words = set(" ".join(train).split())
    held_words = set(" ".join(heldout).split())
    assert train_words and held_words and not train_words & held_words
    rng = np.random.default_rng(0)
    for _ in range(50):
        assert set(pick_snippet(train, rng, 24).split()) <= train_words
        assert set(pick_snippet(heldout, rng, 24).split()) <= held_words
    snippet = pick_snippet(["Supercalifragilisticexpialidocious word"], np.random.default_rng(1), 10)
    assert snippet == "Supercalif"
    with pytest.raises(ValueError, match="no corpus lines"):
        pick_snippet([], rng, 10)


def test_the_turn_and_the_loss_mask(tok):
    cfg = tiny_vision_config()
    examples = [make_example(["first line of words", "second"], [0, i], find_fonts(), tok, cfg, IMAGE_ID)
                for i in range(3)]
    ids, types, mask, images = collate(examples, pad_id=2)
    assert ids.shape == types.shape and mask.shape == (3, ids.shape[1] - 1) and len(images) == 3
    targets = ids[:, 1:]
    for row, e in enumerate(examples):
        # the targets are exactly the answer and the end token
        assert tok.decode(targets[row][mask[row]].tolist(), skip_special_tokens=False) == e.text + EOS
        assert not mask[row, len(e.ids) - 1:].any()  # padding is never a target
        prompt = tok.decode(ids[row, : e.start].tolist(), skip_special_tokens=False)
        assert prompt.endswith(PROMPT + "<｜Assistant｜></think>")
        assert prompt.startswith("<｜begin▁of▁sentence｜><｜User｜>")
        span = types[row] != int(TokenType.TEXT)
        g = e.image.grid
        assert int(span.sum()) == g.n_llm_h * (g.n_llm_w + 1) + 2
        assert bool((ids[row][span] == IMAGE_ID).all()) and int((ids[row] == IMAGE_ID).sum()) == int(span.sum())
        assert int((types[row] == int(TokenType.IMAGE)).sum()) == g.n_llm_h * g.n_llm_w
        assert int(span.nonzero().max()) < e.start  # the span lies in the prompt
        assert bool((types[row, len(e.ids):] == int(TokenType.TEXT)).all())


@pytest.mark.parametrize(("a", "b", "d"), [("kitten", "sitting", 3), ("", "abc", 3), ("abc", "", 3),
                                           ("abc", "abc", 0), ("flaw", "lawn", 2), ("ab", "ba", 2),
                                           ("intention", "execution", 5)])
def test_edit_distance_hand_cases(a, b, d):
    assert edit_distance(a, b) == d == edit_distance(b, a)


def test_char_accuracy_hand_cases():
    r = char_accuracy(["abc", "de"], ["abd", "de"])
    assert r["edits"] == 1 and r["chars"] == 5 and r["cer"] == pytest.approx(0.2)
    assert r["char_accuracy"] == pytest.approx(0.8) and r["exact_match"] == 0.5
    assert char_accuracy(["ab"], ["abxxxxxxx"])["char_accuracy"] == 0.0  # floored: CER 3.5
    assert char_accuracy(["ab"], [""])["cer"] == 1.0
    with pytest.raises(ValueError, match="references"):
        char_accuracy(["a"], ["a", "b"])
    with pytest.raises(ValueError, match="no characters"):
        char_accuracy([""], [""])


def test_render_text_fits_the_width_cap():
    from deepseek_v41.train.vision_data import RenderSpec

    spec = RenderSpec(layout="line", max_tokens_w=4)
    image, _, _ = render_text("a rather long line of text for four tokens", np.random.default_rng(0), find_fonts(),
                              spec)
    assert image.width <= 4 * 42 and image.width % 42 == 0
    with pytest.raises(ValueError, match="do not fit 4 cells"):
        render_text("five!", np.random.default_rng(0), find_fonts(), RenderSpec(max_tokens_w=4))
    with pytest.raises(ValueError, match="unknown render layout 'grid'"):
        render_text("x", np.random.default_rng(0), find_fonts(), RenderSpec(layout="grid"))
    for bad in ("two\nlines", "a\tb", ""):
        with pytest.raises(ValueError, match="printable characters"):
            render_text(bad, np.random.default_rng(0), find_fonts())
    with pytest.raises(FileNotFoundError, match="nope.ttf"):
        render_text("x", np.random.default_rng(0), ["/nope.ttf"])


@pytest.mark.parametrize("fonts", ["installed", "none"])
def test_cells_layout_draws_one_character_per_cell(fonts):
    """Each character's ink lies in its own 42-pixel cell; a space's cell and the blank cells after the text hold
    none (no rotation, noise or blur here; the faint stray strokes stay under the ink threshold)."""
    from deepseek_v41.train.vision_data import RenderSpec

    spec = RenderSpec(max_degrees=0.0, max_noise=0.0)
    font_list = find_fonts() if fonts == "installed" else []
    for seed, text in enumerate(["Wm i.l", "HELLO world", "(x)=y;", "a b"]):
        rng = np.random.default_rng([5, seed])
        image, _, centres = render_text(text, rng, font_list, spec)
        assert image.height == 42 and len(text) * 42 <= image.width <= (len(text) + 2) * 42
        assert np.array_equal(centres, (np.arange(len(text)) + 0.5) * 42)
        pixels = np.asarray(image, dtype=np.float32)
        background = np.median(pixels.reshape(-1, 3), axis=0)
        far = np.abs(pixels - background).max(-1)
        ink = far > 0.7 * far.max()
        per_cell = ink.reshape(42, -1, 42).sum((0, 2))
        for j in range(image.width // 42):
            has_char = j < len(text) and text[j] != " "
            assert (per_cell[j] > 0) == has_char, (text, j, per_cell)


def test_cell_labels_give_each_column_its_character_or_blank():
    import torch

    from deepseek_v41.model.image_processor import ImageGrid, ProcessedImage
    from deepseek_v41.train.vision_data import BLANK, VisionExample, cell_labels

    grid = ImageGrid(42, 168, 3, 12, 1, 4)
    image = ProcessedImage(torch.zeros(36, 588), grid)
    e = VisionExample(np.zeros(1, np.int64), np.zeros(1, np.int64), 1, image, "ab c~",
                      np.array([10.0, 50.0, 70.0, 200.0, 83.9], np.float32))
    # 'b' and ' ' share column 1 (the last one wins), 'c' is clamped into column 3, '~' lands in column 1 last
    assert cell_labels(e).tolist() == [ord("a") - 32, ord("~") - 32, BLANK, ord("c") - 32]
    with pytest.raises(ValueError, match="no character positions"):
        cell_labels(VisionExample(e.ids, e.token_types, 1, image, "a"))


def test_spelled_answers_are_one_token_per_character(tok):
    from deepseek_v41.train.vision_data import char_token_ids

    table = char_token_ids(tok)
    assert len(table) == 95 and len(set(table)) == 95
    assert [tok.decode([t]) for t in table] == [chr(c) for c in range(32, 127)]
    cfg = tiny_vision_config()
    _, image, _, _ = render_sample(["hello world"], [0, 1], find_fonts())
    spelled = build_example("hello world", image, tok, cfg, IMAGE_ID)
    plain = build_example("hello world", image, tok, cfg, IMAGE_ID, spell=False)
    assert np.array_equal(spelled.ids[: spelled.start], plain.ids[: plain.start])  # the same prompt
    answer = spelled.ids[spelled.start:]
    assert answer.tolist() == [table[ord(c) - 32] for c in "hello world"] + [tok.token_to_id(EOS)]
    assert tok.decode(answer.tolist(), skip_special_tokens=True) == "hello world"
    assert len(plain.ids) - plain.start < len(answer)  # the tokenizer's own encoding is shorter
    with pytest.raises(ValueError, match="printable ASCII only"):
        build_example("caf\u00e9", image, tok, cfg, IMAGE_ID)


def test_render_centres_follow_the_text():
    text, image, _, centres = render_sample(["left right"], [0, 3], find_fonts())
    assert centres.shape == (len(text),) and np.all(np.diff(centres) > 0)
    assert centres[0] > 0 and centres[-1] < image.width
    # the ink of the first and last characters is near their centres: darkest columns lie inside [first, last]
    gray = np.asarray(image.convert("L"), dtype=np.float32)
    ink = np.abs(gray - np.median(gray)).mean(0)
    cols = np.nonzero(ink > ink.max() * 0.5)[0]
    assert cols.min() > centres[0] - 20 and cols.max() < centres[-1] + 20
