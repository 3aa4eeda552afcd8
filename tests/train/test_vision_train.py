"""``dsv41 train-vlm`` (issue 27): the VLM is the text checkpoint plus a fresh vision path; a few steps lower the
masked loss through the vision path and leave the draft and Engram tables; batches are a function of the step
(resume); the batched greedy loop equals one row at a time; the CLI refuses a folder that is not a corpus."""

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from typer.testing import CliRunner

from deepseek_v41.cli.main import app
from deepseek_v41.config import tiny_config
from deepseek_v41.model.checkpoint import load_model
from deepseek_v41.model.transformer import Transformer
from deepseek_v41.train.vision_data import collate, find_fonts, make_example
from deepseek_v41.train.vlm import (
    VISION_PARAMS,
    VLMArgs,
    VLMTrainer,
    build_vlm,
    greedy_transcribe,
    tiny_vision_config,
    vlm_loss,
)

CHAT = Path(__file__).parents[2] / "checkpoints" / "v41-tiny-chat"
LINES = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(CHAT / "tokenizer.json"))


def tiny_vlm(seed: int = 0) -> Transformer:
    """A random tiny model over the bundled tokenizer's 8,192 ids with a 1-block vision path."""
    torch.manual_seed(seed)
    return Transformer(tiny_config().replace(
        vocab_size=8192, engram_compressed_vocab_size=8192, dspark_noise_token_id=8191, image_token_id=8190,
        vision_config=tiny_vision_config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2)))


def test_build_vlm_keeps_the_text_weights_and_adds_a_fresh_vision_path(tmp_path):
    model = build_vlm(CHAT, tiny_vision_config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    base = load_model(CHAT)
    text = base.state_dict()
    for name, value in model.state_dict().items():
        if name in text:
            assert torch.equal(value, text[name]), name
        elif name.endswith(".bias_vl"):
            assert torch.equal(value, text[name[: -len("_vl")]])  # image tokens first route as text does
        else:
            assert name.startswith(VISION_PARAMS), name
    assert model.config.vision_config.min_pixels == 42 * 42 and model.hasher.has_token_map
    ids = torch.randint(3, 8000, (1, 12))
    assert all(torch.equal(a, b) for a, b in zip(model.hasher(ids).values(), base.hasher(ids).values(), strict=True))
    tiny_vlm().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="already has a vision path"):
        build_vlm(tmp_path, tiny_vision_config())


def test_training_lowers_the_loss_through_the_vision_path(tmp_path, tok):
    model = tiny_vlm()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()
              if n.startswith("mtp.") or ".engram.embed." in n}
    args = VLMArgs(steps=8, batch_size=4, lr=3e-3, text_lr=3e-3, warmup_steps=1, eval_every=0,
                   checkpoint_minutes=1e9, vision_only_steps=0, vision_lm_start=400)
    trainer = VLMTrainer(model, tok, LINES, [], find_fonts(), tmp_path, args)
    ids, types, mask, images = trainer.batch(0)
    with torch.no_grad():
        before = vlm_loss(model, ids, types, mask, images)[1]["lm"]
    loss, _ = vlm_loss(model, ids, types, mask, images)
    loss.backward()
    assert model.vision.patch_embed.proj.weight.grad.abs().sum() > 0  # the loss reaches the ViT
    assert model.image_start.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    state = trainer.train(log=lambda line: None)
    with torch.no_grad():
        after = vlm_loss(model, ids, types, mask, images)[1]["lm"]
    assert state.step == 8 and after < before - 0.5
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert (tmp_path / "checkpoint" / "state.json").is_file()


def test_batches_are_a_function_of_the_step_and_resume_continues(tmp_path, tok):
    args = VLMArgs(steps=4, batch_size=2, warmup_steps=1, eval_every=0, checkpoint_minutes=1e9, vision_only_steps=2,
                   vision_lm_start=2)
    whole = VLMTrainer(tiny_vlm(), tok, LINES, [], find_fonts(), tmp_path / "a", args)
    first = whole.batch(3)
    assert torch.equal(first[0], VLMTrainer(tiny_vlm(), tok, LINES, [], find_fonts(), tmp_path / "c", args).batch(3)[0])
    assert not torch.equal(whole.batch(2)[0][:, :5], first[0][:, :5]) or whole.batch(2)[0].shape != first[0].shape
    whole.train(log=lambda line: None)
    VLMTrainer(tiny_vlm(), tok, LINES, [], find_fonts(), tmp_path / "b", args).train(stop_at=2, log=lambda line: None)
    resumed = VLMTrainer(tiny_vlm(), tok, LINES, [], find_fonts(), tmp_path / "b", args, resume=True)
    assert resumed.state.step == 2
    resumed.train(log=lambda line: None)
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_batched_greedy_equals_one_row_at_a_time(tok):
    model = tiny_vlm(1).eval()
    cfg = model.config
    examples = [make_example(LINES, [5, i], find_fonts(), tok, cfg.vision_config, cfg.image_token_id)
                for i in range(4)]
    assert len({len(e.ids[: e.start]) for e in examples}) > 1  # rows of different prompt lengths
    together = greedy_transcribe(model, tok, examples, with_image=True, max_new_tokens=5, batch_size=4)
    alone = [greedy_transcribe(model, tok, [e], with_image=True, max_new_tokens=5)[0] for e in examples]
    assert together == alone and all(isinstance(t, str) for t in together)
    ids, types, _, images = collate(examples[:1], cfg.pad_token_id)
    with torch.no_grad():  # the first greedy token is the argmax after the prompt of the exact forward
        logits = model(ids[:, : examples[0].start], token_types=types[:, : examples[0].start], images=images)
    first = int(logits[0, -1].argmax())
    if first != cfg.eos_token_id:
        assert alone[0].startswith(tok.decode([first], skip_special_tokens=True))
    blind = greedy_transcribe(model, tok, examples[:2], with_image=False, max_new_tokens=5)
    assert blind[0] == blind[1]  # without the image every prompt is the same


def test_cli_refuses_a_folder_without_corpus_splits(tmp_path):
    result = CliRunner().invoke(app, ["train-vlm", "--model", str(CHAT), "--data", str(tmp_path),
                                      "--out", str(tmp_path / "run"), "--steps", "1"])
    assert result.exit_code == 2 and "train.txt" in result.output


def test_lines_are_rendered_from_the_trainers_lines(tmp_path, tok):
    trainer = VLMTrainer(tiny_vlm(), tok, ["onlyword"], [], find_fonts(), tmp_path,
                         VLMArgs(steps=1, batch_size=3, eval_every=0))
    ids, _, mask, _ = trainer.batch(0)
    answers = {tok.decode(ids[r, 1:][mask[r]].tolist(), skip_special_tokens=True) for r in range(3)}
    assert answers == {"onlyword"}
    assert np.all(mask.sum(1).numpy() > 0)


def test_read_image_is_the_greedy_answer_to_the_prompt(tmp_path, tok):
    from deepseek_v41.train.vision_data import render_sample
    from deepseek_v41.train.vlm import read_image

    model = tiny_vlm(2).eval()
    cfg = model.config
    text, image, _, _ = render_sample(LINES, [9, 0], find_fonts())
    image.save(tmp_path / "x.png")
    example = make_example(LINES, [9, 0], find_fonts(), tok, cfg.vision_config, cfg.image_token_id)
    assert example.text == text
    expected = greedy_transcribe(model, tok, [example], with_image=True, max_new_tokens=4)[0]
    assert read_image(model, tok, tmp_path / "x.png", max_new_tokens=4) == expected
    assert read_image(model, tok, (tmp_path / "x.png").read_bytes(), max_new_tokens=4) == expected
    with pytest.raises(ValueError, match="no vision path"):
        read_image(load_model(CHAT), tok, tmp_path / "x.png")


@pytest.mark.parametrize("start", [0, 100])
def test_the_lm_loss_reaches_the_vision_path_only_from_vision_lm_start(tmp_path, tok, start):
    model = tiny_vlm(3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = VLMArgs(steps=2, batch_size=2, warmup_steps=1, eval_every=0, checkpoint_minutes=1e9, cell_loss_weight=0.0,
                   vision_lm_start=start, vision_only_steps=0)
    VLMTrainer(model, tok, LINES, [], find_fonts(), tmp_path, args).train(log=lambda line: None)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    tower = {n for n in before if n.startswith(("vision.", "aligner."))}
    assert "head.weight" in moved and "image_start" in moved  # the text model and the delimiters train
    assert (tower <= moved) if start == 0 else not (tower & moved)


def test_vision_only_steps_train_the_tower_and_probe_alone_with_their_own_schedule(tmp_path, tok):
    model = tiny_vlm(4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = VLMArgs(steps=10, batch_size=2, warmup_steps=2, eval_every=0, checkpoint_minutes=1e9,
                   vision_only_steps=2, vision_lm_start=2)
    trainer = VLMTrainer(model, tok, LINES, [], find_fonts(), tmp_path, args)
    assert trainer.lr_at(1) == trainer.lr_at(3) == args.lr and trainer.lr_at(0) == args.lr / 2  # warmup twice
    state = trainer.train(stop_at=2, log=lambda line: None)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(n.startswith(("vision.", "aligner.")) for n in moved)
    assert all(not np.isfinite(h["lm"]) and np.isfinite(h["cell"]) for h in state.history)


def test_the_match_term_is_zero_when_character_rows_are_their_embeddings(tok):
    """cell_loss's match term: a character column's row against its character's token embedding (blank columns
    carry none); the probe's cross-entropy and accuracy come with it."""
    from deepseek_v41.model.image_processor import ImageGrid, ProcessedImage
    from deepseek_v41.train.vision_data import VisionExample, char_token_ids
    from deepseek_v41.train.vlm import cell_loss

    model = tiny_vlm(5)
    table = torch.tensor(char_token_ids(tok))
    grid = ImageGrid(42, 126, 3, 9, 1, 3)
    example = VisionExample(np.zeros(1, np.int64), np.zeros(1, np.int64), 1, ProcessedImage(torch.zeros(27, 588), grid),
                            "ab", np.array([21.0, 63.0], np.float32))
    rows = torch.randn(3, model.config.hidden_size)
    embed = model.embed.weight.detach()
    rows[:2] = embed[table[[ord("a") - 32, ord("b") - 32]]]
    probe = torch.nn.Linear(model.config.hidden_size, 96)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr("deepseek_v41.train.vlm.encode_images", lambda owner, images: [rows])
        _, parts = cell_loss(model, probe, [example], table, match_weight=1.0)
        assert parts["match"] == 0.0 and np.isfinite(parts["cell"]) and 0 <= parts["cell_acc"] <= 1
        rows[0] = embed[table[ord("c") - 32]]  # the wrong character's embedding
        moved = cell_loss(model, probe, [example], table, match_weight=1.0)[1]["match"]
        expected = (rows[:2] - embed[table[[ord("a") - 32, ord("b") - 32]]]).pow(2).mean() / embed.pow(2).mean()
        assert moved == pytest.approx(float(expected)) and moved > 0
        rows[2] = 100.0  # a blank column: no match target, only the scale term sees it
        assert cell_loss(model, probe, [example], table, match_weight=1.0)[1]["match"] == pytest.approx(moved)


@pytest.mark.slow
def test_train_vlm_command_exports_scores_and_writes_the_card(tmp_path):
    """`dsv41 train-vlm` end to end on a tiny corpus: checkpoint, bf16 export with the tokenizer, the held-out
    scores (with / without the image, the base, the line layout), vlm_train.json, MODEL_CARD.md, example.png."""
    import json

    from deepseek_v41.train.data import write_documents

    data = tmp_path / "corpus"
    data.mkdir()
    write_documents(data / "train.txt", ["alpha beta gamma delta", "epsilon zeta eta"])
    write_documents(data / "heldout.txt", ["Aleph Bet Gimel", "He Vav Zayin"])
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train-vlm", "--model", str(CHAT), "--data", str(data), "--out", str(out),
                                      "--steps", "3", "--vision-only-steps", "1", "--vision-lm-start", "1",
                                      "--batch-size", "2", "--warmup-steps", "1", "--eval-every", "0",
                                      "--eval-samples", "3", "--vision-width", "16", "--vision-layers", "1",
                                      "--vision-heads", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    model = out / "model"
    facts = json.loads((model / "vlm_train.json").read_text())
    assert facts["steps"] == 3 and facts["args"]["spell_answers"] is True
    for key in ("with_image", "text_only", "base_text_only", "line_layout"):
        assert facts["final_eval"][key]["samples"] == 3 and 0 <= facts["final_eval"][key]["char_accuracy"] <= 1
    card = (model / "MODEL_CARD.md").read_text()
    assert "| this model, with the image |" in card and 'layout "line", not trained on' in card
    assert (model / "example.png").is_file() and (model / "example.txt").read_text().strip()
    assert load_model(model).config.vision_config.hidden_size == 16


def test_the_shipped_tiny_vl_reads_its_example_and_fresh_renders(tok):
    """checkpoints/v41-tiny-vl transcribes its held-out example.png and renders of hand-picked words (the
    training renderer, seeds no training step uses) with the exact forward."""
    from deepseek_v41.train.vision_data import char_accuracy, render_text
    from deepseek_v41.train.vlm import read_image

    folder = CHAT.parent / "v41-tiny-vl"
    model = load_model(folder, dtype=torch.float32)
    assert read_image(model, tok, folder / "example.png") == (folder / "example.txt").read_text().strip()
    words = ["Quiet river", "x = 42;", "open(path)", "MAX_LEN"]
    answers = [read_image(model, tok, render_text(w, np.random.default_rng([99, i]), find_fonts())[0])
               for i, w in enumerate(words)]
    assert char_accuracy(words, answers)["char_accuracy"] >= 0.8, answers


def test_train_vlm_refuses_what_would_break_the_cells(tmp_path, tok):
    """A span cap below the widest render's (it would be scaled down: no longer one character per cell), a model
    folder that is not one, and a resumed run whose checkpoint does not fit: clear errors, exit 2."""
    from deepseek_v41.train.data import write_documents
    from deepseek_v41.train.vision_data import build_example, render_text

    data = tmp_path / "corpus"
    data.mkdir()
    write_documents(data / "train.txt", ["alpha beta"])
    write_documents(data / "heldout.txt", ["gamma delta"])
    common = ["--data", str(data), "--steps", "1", "--batch-size", "1", "--eval-samples", "1", "--eval-every", "0",
              "--vision-width", "16", "--vision-layers", "1", "--vision-heads", "2", "--threads", "1"]
    small = CliRunner().invoke(app, ["train-vlm", "--model", str(CHAT), "--out", str(tmp_path / "a"),
                                     "--max-image-tokens", "10", *common])
    assert small.exit_code == 2 and "max_image_tokens 10 is below 19" in small.output
    missing = CliRunner().invoke(app, ["train-vlm", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "b"),
                                       *common])
    assert missing.exit_code == 2 and "is not a model folder" in missing.output
    image = render_text("sixteen chars ok", np.random.default_rng(0), find_fonts())[0]
    with pytest.raises(ValueError, match="exceeds max_image_tokens 10"):
        build_example("sixteen chars ok", image, tok, tiny_vision_config(max_image_tokens=10), 8190)
    args = VLMArgs(steps=1, batch_size=1, eval_every=0)
    VLMTrainer(tiny_vlm(), tok, LINES, [], find_fonts(), tmp_path / "c", args).save_checkpoint()
    torch.manual_seed(0)
    wider = Transformer(tiny_vlm().config.replace(vision_config=tiny_vision_config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2)))
    with pytest.raises(ValueError, match="does not fit this model"):
        VLMTrainer(wider, tok, LINES, [], find_fonts(), tmp_path / "c", args, resume=True)
