"""The length predictor against independent references: sentence-transformers' own
embeddings (numbers recorded from it), exact nearest neighbours by brute force, the
prediction rule recomputed by hand, and a real train / save / load / learn cycle."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tandem.predictor.embed import DIM, Embedder
from tandem.predictor.evaluate import lad_line, spearman
from tandem.predictor.head import LengthHead
from tandem.predictor.index import LengthIndex
from tandem.predictor.model import LengthPredictor, Settings
from tandem.predictor.text import TextHead

SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.",
             "The new movie is awful and far too long for anyone to enjoy it."]
# sentence-transformers 6.2 on the packaged all-MiniLM-L6-v2, max_seq_length=12,
# normalize_embeddings=True: the first four components and two cosine similarities
ST_HEAD = [[0.03324, 0.00441, -0.00628, 0.04838], [0.05252, 0.05524, -0.01119, -0.00575],
           [-0.03446, -0.05527, 0.0522, -0.01773]]
ST_COS01, ST_COS02 = 0.755337, -0.028923


@pytest.fixture(scope="module")
def embedder():
    return Embedder(max_tokens=12)


def _unit(rng, n):
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_embeddings_match_sentence_transformers(embedder):
    e = embedder.encode(SENTENCES)
    assert e.shape == (3, DIM)
    np.testing.assert_allclose(e[:, :4], ST_HEAD, atol=2e-5)
    assert abs(float(e[0] @ e[1]) - ST_COS01) < 1e-4
    assert abs(float(e[0] @ e[2]) - ST_COS02) < 1e-4
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    # the batch order (sorted by length inside) does not change any vector
    np.testing.assert_allclose(embedder.encode(SENTENCES[::-1])[::-1], e, atol=1e-6)


def test_index_neighbours_match_brute_force():
    rng = np.random.default_rng(0)
    base = _unit(rng, 3000)
    lengths = rng.integers(1, 2000, 3000)
    ix = LengthIndex(DIM, capacity=100)          # grows by resizing
    for s in range(0, 3000, 700):
        ix.add(base[s:s + 700], lengths[s:s + 700])
    q = base[rng.choice(3000, 50)] + 0.3 * _unit(rng, 50)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    sims, lens = ix.query(q, 10)
    exact = np.argsort(-(q @ base.T), axis=1)[:, :10]
    found = 0
    for i in range(50):
        # every returned pair is a real (similarity, length) of the base set
        ids = [np.flatnonzero(np.isclose(q[i] @ base.T, s, atol=1e-5)) for s in sims[i]]
        assert all(lengths[j].tolist().count(L) or L in lengths[j] for j, L in zip(ids, lens[i]))
        found += len(set(exact[i]) & {int(j[0]) for j in ids if len(j)})
    assert found / 500 >= 0.9                   # recall against exact search
    assert np.all(np.diff(sims, axis=1) <= 1e-6)  # most similar first


def test_learned_lengths_are_bounded_the_newest_replacing_the_oldest(tmp_path):
    """Beyond its trained entries the index keeps the ``max_learned`` newest learned ones: each
    query answers as exact search over the trained entries and those newest ones would, the
    trained ones are never replaced, hnswlib's preallocation stops at the bound, and the order
    of replacement survives a save and a load."""
    rng = np.random.default_rng(3)
    seed, learned = _unit(rng, 40), _unit(rng, 30)
    seed_len, learned_len = rng.integers(1, 500, 40), rng.integers(1000, 2000, 30)
    ix = LengthIndex(DIM, capacity=8)                 # as training builds it: no bound
    ix.add(seed, seed_len)
    ix.keep_all()
    ix.max_learned = 6                                # as a server loads it

    def live(n_added):                     # the trained entries and the 6 newest learned, exactly
        lo = max(0, n_added - 6)
        return np.vstack([seed, learned[lo:n_added]]), np.concatenate([seed_len, learned_len[lo:n_added]])

    def check(index, n_added):
        vecs, lens = live(n_added)
        assert len(index) == len(vecs)
        q = np.vstack([vecs, _unit(rng, 10)])
        sims, got = index.query(q, 1)
        best = np.argmax(q @ vecs.T, axis=1)
        np.testing.assert_allclose(sims[:, 0], (q @ vecs.T)[np.arange(len(q)), best], atol=1e-5)
        assert got[:, 0].tolist() == lens[best].tolist()
    ix.add(learned[:4], learned_len[:4])          # room for all four
    check(ix, 4)
    ix.add(learned[4:9], learned_len[4:9])        # two more fit, three replace the oldest
    check(ix, 9)
    assert ix._index.get_max_elements() <= 40 + 6
    ix.save(tmp_path)
    back = LengthIndex.load(tmp_path, DIM, max_learned=6)
    i = 9
    for size in (2, 3, 1, 7, 4, 2, 2):           # a batch longer than the bound, too
        back.add(learned[i:i + size], learned_len[i:i + size])
        i += size
        check(back, i)
    assert back._index.get_max_elements() <= 40 + 6


def _wquantile(values, weights, q):
    """Reference weighted quantile: walk the sorted values until q of the weight is reached."""
    if not any(weights):
        weights = [1.0] * len(values)
    pairs = sorted(zip(values, weights))
    total, acc = sum(weights), 0.0
    for v, w in pairs:
        acc += w
        if acc >= q * total:
            return v
    return pairs[-1][0]


def _wmedian(values, weights):
    return _wquantile(values, weights, 0.5)


def _spread(values, weights, scale=1.0):
    return tuple(max(1, round(_wquantile(values, weights, (j + 0.5) / 8) * scale)) for j in range(8))


def test_prediction_rule_by_hand():
    rng = np.random.default_rng(1)
    base = _unit(rng, 400)
    lengths = rng.integers(1, 1000, 400)
    head = LengthHead(DIM, 32)
    head.fit(base, rng.integers(10, 5000, 400), lengths, epochs=3)
    words = ["brief", "essay", "code", "list", "why", "story"]
    corpus = [" ".join(rng.choice(words, 6)) for _ in range(400)]
    text = TextHead(16)
    text.fit(corpus, lengths, epochs=2)
    s = Settings(k=8, threshold=0.8, hidden=32, text_hidden=16)
    ix = LengthIndex(DIM, ef=400)               # searches every item: exact, as the reference
    ix.add(base, lengths)
    p = LengthPredictor(s, head, ix, text=text)
    near = base[:20] + 0.2 * _unit(rng, 20)     # close to a stored prompt: retrieval
    far = _unit(rng, 20)                        # unlike anything: the fallback
    q = np.concatenate([near, far])
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    texts = [" ".join(rng.choice(words, n)) for n in rng.integers(1, 30, 40)]
    got = p.predict_vectors(q, texts)
    mlp = head.predict(q, [len(t) for t in texts])
    second = text.predict(texts)
    for i, g in enumerate(got):
        sim = q[i] @ base.T
        top = np.argsort(-sim)[:8]
        if sim[top[0]] >= 0.8:
            keep = [j for j in top if sim[j] >= 0.8]
            want = sum(sim[j] * lengths[j] for j in keep) / sum(sim[j] for j in keep)
            assert g.retrieved
            assert g.spread == _spread([lengths[j] for j in keep], [sim[j] for j in keep]), i
        else:
            ls, ws = [lengths[j] for j in top], [max(sim[j], 0) for j in top]
            want = math.sqrt((0.5 * mlp[i] + 0.5 * _wmedian(ls, ws)) * second[i])
            assert not g.retrieved
            assert g.spread == _spread(ls, ws, want / _wmedian(ls, ws)), i
        assert g.length == max(1, round(want)), i
        assert list(g.spread) == sorted(g.spread)
        assert abs(g.similarity - sim[top[0]]) < 1e-4
    assert sum(g.retrieved for g in got) == 20


def test_empty_index_uses_the_mlp():
    rng = np.random.default_rng(2)
    head = LengthHead(DIM, 16)
    p = LengthPredictor(Settings(hidden=16), head)
    q = _unit(rng, 3)
    got = p.predict_vectors(q, ["a" * 5, "b" * 50, "c" * 500])
    assert [g.length for g in got] == [max(1, round(x)) for x in head.predict(q, [5, 50, 500])]
    assert not any(g.retrieved for g in got)
    assert all(g.spread == () for g in got)       # no neighbours, no spread: the length alone


def test_lad_line_is_the_least_absolute_deviation_fit():
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 100, 300)
    y = 3 + 2 * x + rng.standard_cauchy(300) * 5
    a, b = lad_line(x, y)
    cost = np.abs(y - a - b * x).sum()
    grid = min(np.abs(y - aa - bb * x).sum() for aa in np.linspace(-10, 15, 101) for bb in np.linspace(1.5, 2.5, 101))
    assert cost <= grid + 1e-6 * grid


def test_rank_correlation_by_counting():
    """Spearman's rho: without ties the textbook 1 - 6 Σd² / (n(n² - 1)); with ties the Pearson
    correlation of ranks counted by hand (values below, plus half the others equal)."""
    rng = np.random.default_rng(4)
    a, b = rng.permutation(50).astype(float), rng.permutation(50).astype(float)
    assert spearman(a, b) == pytest.approx(1 - 6 * ((a - b) ** 2).sum() / (50 * (50 ** 2 - 1)))
    x, y = rng.integers(0, 5, 60), rng.integers(0, 7, 60)

    def rank(v):
        return np.array([(v < e).sum() + ((v == e).sum() - 1) / 2 for e in v])
    rx, ry = rank(x), rank(y)
    want = ((rx - rx.mean()) * (ry - ry.mean())).sum() / np.sqrt(((rx - rx.mean()) ** 2).sum() * ((ry - ry.mean()) ** 2).sum())
    assert spearman(x, y) == pytest.approx(want)
    assert spearman(np.full(10, 3.0), np.arange(10)) == 0.0      # a constant predictor ranks nothing


def test_train_save_load_and_learn_online(tmp_path, embedder):
    from tandem.predictor.data import Examples
    from tandem.predictor.train import train
    topics = ["Write a poem about", "Translate to French:", "Fix this Python bug:", "Summarize the article on"]
    words = ["rivers", "taxes", "cats", "rockets", "bread", "chess", "winter", "robots"]
    prompts = [f"{t} {w} {i}" for i in range(6) for t in topics for w in words]
    lens = np.array([50 * (1 + topics.index(p.rsplit(' ', 2)[0])) for p in prompts])
    ex = Examples(prompts, lens, np.full(len(prompts), 8), np.arange(len(prompts)))
    s = Settings(k=5, threshold=0.8, max_tokens=12, hidden=32)
    p = train(ex, s, epochs=5, out=tmp_path, log=lambda _: None)
    q = ["Translate to French: rockets 99", "Summarize the article on chess 77"]
    first = p.predict_detailed(q)
    assert all(f.retrieved for f in first)
    assert [f.length for f in first] == pytest.approx([100, 200], abs=10)
    loaded = LengthPredictor.load(tmp_path)
    assert loaded.predict(q) == [f.length for f in first]
    novel = "Compose a limerick in Klingon about quantum entanglement of teapots"
    loaded.observe([novel], [777])
    assert loaded.predict([novel]) == [777]
    loaded.save(tmp_path)
    assert LengthPredictor.load(tmp_path).predict([novel]) == [777]
    assert len(LengthPredictor.load(tmp_path).index) == len(prompts) + 1


def test_training_refuses_held_out_records():
    from tandem.bench.workloads import HELD_OUT_FROM
    from tandem.predictor.data import Examples
    from tandem.predictor.train import train
    ex = Examples(["a", "b"], np.array([3, 4]), np.array([1, 1]), np.array([5, HELD_OUT_FROM]))
    with pytest.raises(ValueError, match="held-out"):
        train(ex, Settings(hidden=8), epochs=1, log=lambda _: None)


def test_missing_predictor_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m predictor train"):
        LengthPredictor.load()
    with pytest.raises(TypeError):
        LengthPredictor(Settings(hidden=8), LengthHead(DIM, 8)).predict("one string")


def test_prediction_reads_the_last_user_message():
    """Chat messages, and completion prompts spelling a chat template out (as text or as token
    ids through SmolLM2's real tokenizer), are read as their last user message."""
    from tandem.predictor.data import length_tokenizer
    from tandem.sched.lengths import prediction_text
    tok = length_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Write a haiku\nabout snow"}]
    assert prediction_text(msgs) == "Write a haiku\nabout snow"
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prediction_text(text) == "Write a haiku\nabout snow"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert prediction_text(ids, lambda i: tok.decode(i, skip_special_tokens=False)) == "Write a haiku\nabout snow"
    llama3 = ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert prediction_text(llama3) == "What is 2+2?"
    assert prediction_text("Once upon a time") == "Once upon a time"


def test_length_source_hands_length_and_spread_on_capped_or_not(embedder):
    """What a request carries into the scheduler: the predictor's length and spread, each capped
    by the request's max_tokens unless the cap is off (benchmarks that fix reply lengths through
    max_tokens)."""
    from tandem.sched.lengths import LengthSource
    from tandem.sched.request import Request, SamplingParams
    prompts = [f"Write a long story about {w}" for w in ("cats", "ships", "rain", "glass")]
    vecs = embedder.encode(prompts)
    ix = LengthIndex(DIM, ef=50)
    ix.add(vecs, np.array([300, 500, 700, 900]))
    p = LengthPredictor(Settings(k=4, threshold=0.0, hidden=16), LengthHead(DIM, 16), ix, embedder=embedder)
    sims, lens = ix.query(vecs[:1], 4)
    want = p.predict_vectors(vecs[:1], prompts[:1])[0]
    assert want.length == round(float((sims[0] * lens[0]).sum() / sims[0].sum()))
    assert want.spread == _spread(list(lens[0]), list(sims[0]))
    for cap, expect_len, expect_spread in ((True, min(want.length, 400), tuple(min(x, 400) for x in want.spread)),
                                           (False, want.length, want.spread)):
        r = Request("a", [1, 2, 3], SamplingParams(max_tokens=400))
        LengthSource(p, cap=cap).assign([r], prompts[:1])
        assert (r.predicted_len, r.predicted_spread) == (expect_len, expect_spread)
    assert max(want.spread) > 400 and want.length > 400     # the cap did cut something


def test_length_source_predicts_each_distinct_prompt_once(embedder):
    """n choices of one prompt are n requests: the encoder read the prompt n times (a
    million choices asked for offline took minutes before the first step). Each request still
    gets what the predictor says of its own prompt alone."""
    from tandem.sched.lengths import LengthSource
    from tandem.sched.request import Request, SamplingParams
    prompts = ["Write a long story about cats", "Name a color", "Write a long story about cats"] * 3
    ix = LengthIndex(DIM, ef=50)
    ix.add(embedder.encode(["Write a story", "Name a fruit", "Say hi"]), np.array([400, 5, 3]))
    p = LengthPredictor(Settings(k=3, threshold=0.0, hidden=16), LengthHead(DIM, 16), ix, embedder=embedder)
    alone = [p.predict_vectors(embedder.encode([t]), [t])[0] for t in prompts]
    source, read = LengthSource(p, cap=False), []
    encode = p.encode
    p.encode = lambda texts: read.append(list(texts)) or encode(texts)
    reqs = [Request(str(i), [1, 2], SamplingParams(max_tokens=1000)) for i in range(len(prompts))]
    source.assign(reqs, prompts)
    assert read == [["Write a long story about cats", "Name a color"]]
    assert [(r.predicted_len, r.predicted_spread) for r in reqs] == [(a.length, a.spread) for a in alone]
    assert alone[0].length != alone[1].length


def test_the_sentence_encoder_loads_with_the_length_source_not_at_the_first_request(embedder):
    """Loading the encoder took about a second, which the first chat after start-up paid."""
    from tandem.sched.lengths import LengthSource
    ix = LengthIndex(DIM, ef=50)
    ix.add(embedder.encode(["a", "b"]), np.array([3, 5]))
    p = LengthPredictor(Settings(k=2, threshold=0.0, hidden=16), LengthHead(DIM, 16), ix)
    assert p._embedder is None
    LengthSource(p)
    assert p._embedder is not None


@pytest.mark.parametrize("max_tokens", [12, 64])
def test_embeddings_match_transformers_bert(max_tokens):
    """The encoder's own forward pass and tokenizer against transformers' BertModel and
    BertTokenizerFast, the same mean pooling on top: prompts longer and shorter than the cut,
    accents, capitals, CJK, emoji and code, in one padded batch."""
    import torch
    from transformers import AutoModel, AutoTokenizer
    from tandem.predictor.embed import model_dir
    texts = SENTENCES + ["Écris un poème sur l'été, s'il te plaît — en alexandrins !", "東京の天気は？ 🌧️",
                         "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # squares",
                         "Summarize: " + " ".join(f"word{i}" for i in range(200)), "?", "HELLO World"]
    tok, model = AutoTokenizer.from_pretrained(model_dir()), AutoModel.from_pretrained(model_dir()).eval()
    b = tok(texts, padding=True, truncation=True, max_length=max_tokens, return_tensors="pt")
    with torch.inference_mode():
        h = model(**b).last_hidden_state
    m = b["attention_mask"].unsqueeze(-1).float()
    want = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()
    got = Embedder(max_tokens).encode(texts)
    np.testing.assert_allclose(got, want, atol=2e-6)


def test_loading_the_encoder_imports_no_transformers_model():
    """Every server start loads the encoder: importing transformers' BERT (and with it its
    generation and compiler modules) cost about 5 s of each start."""
    import subprocess
    import sys
    code = ("import sys; from tandem.predictor.embed import Embedder; Embedder().encode(['hi']); "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers', 'torch._dynamo'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
