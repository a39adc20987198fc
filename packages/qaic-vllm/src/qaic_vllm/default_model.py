"""The default model: a small Llama trained on the CPU, on first use, on English text that ships with Python.

Nothing is downloaded: the text is ``pydoc_data.topics`` (the language reference's topics) and the
docstrings of standard-library modules, the tokenizer is a byte-level BPE trained on the same text,
and the weights come from a fixed number of plain torch training steps from a fixed seed, so
``qaic-vllm serve-default`` works on an offline machine and answers in words. ``build_model`` still
writes the small random-weight Llamas that tests build with the package's own tokenizer.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import logging
import math
import os
import platform
import random
import re
import shutil
import tempfile
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

log = logging.getLogger("qaic.vllm.model")

DEFAULT_MODEL_NAME = "qaic-tiny-llama"
BUILD_VERSION = 2
MARKER = "qaic_model.json"
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "initializer_range": 0.08,
    "tie_word_embeddings": False,
}
TOKENIZER_VOCAB = 4000


# fmt: off
STDLIB_MODULES: tuple[str, ...] = (
    "abc", "argparse", "array", "base64", "bisect", "calendar", "collections", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions",
    "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "inspect", "io", "ipaddress",
    "itertools", "json", "logging", "math", "operator", "os", "pathlib", "pickle", "pprint", "queue",
    "random", "re", "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics", "string",
    "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time", "timeit",
    "typing", "unittest", "urllib.parse", "uuid", "weakref", "zipfile", "zlib",
)
# fmt: on
"""Standard-library modules whose docstrings join ``pydoc_data.topics`` in the training text."""
MAX_TRAIN_THREADS = 8


@dataclass(frozen=True)
class TrainingRecipe:
    """Everything the default model's weights depend on; its ``key()`` names the cached build."""

    seed: int = 0
    steps: int = 480
    batch_size: int = 16
    seq_len: int = 128
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    vocab_size: int = 1099
    """Today's vocabulary size, so the model keeps the shape benchmarks were measured with."""
    modules: tuple[str, ...] = STDLIB_MODULES
    config: dict[str, Any] = field(default_factory=lambda: {**DEFAULT_CONFIG, "initializer_range": 0.02})

    def key(self) -> str:
        """A digest of the recipe, the build version and the Python whose text it trains on."""
        described = {"build": BUILD_VERSION, "python": platform.python_version(), **asdict(self)}
        return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


DEFAULT_RECIPE = TrainingRecipe()


def models_home() -> Path:
    """``$QAIC_HOME/models`` or ``~/.cache/qaic/models``."""
    raw = os.environ.get("QAIC_HOME", "").strip()
    base = Path(raw).expanduser() if raw else Path.home() / ".cache" / "qaic"
    return base / "models"


def default_model_dir() -> Path:
    return models_home() / DEFAULT_MODEL_NAME


def corpus_lines() -> list[str]:
    """The training text shipped with the package."""
    text = resources.files("qaic_vllm").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


_ASCII_PUNCTUATION = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": "-",
        "\u2014": "-",
        "\u2026": "...",
    }
)
_RULE = re.compile(r"^[*=~^#+-]{3,}$")


def ascii_text(text: str) -> str:
    """``text`` in plain ASCII: the model never learns a byte that could cut a character in two."""
    text = unicodedata.normalize("NFKD", text.translate(_ASCII_PUNCTUATION))
    return text.encode("ascii", "ignore").decode("ascii")


def prose_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of reST-like text, each on one line; code, grammar and rules dropped."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", ascii_text(text)):
        lines = [line for line in block.splitlines() if line.strip() and not _RULE.match(line.strip())]
        if not lines or any(line.startswith((" ", "\t", ">>>", "...")) for line in lines):
            continue
        paragraph = " ".join(" ".join(lines).split())
        if len(paragraph.split()) >= 4:
            paragraphs.append(paragraph)
    return paragraphs


def topic_texts() -> dict[str, str]:
    """``pydoc_data.topics``: the language reference's topics, by name (the text ``help()`` shows)."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def docstrings(modules: Iterable[str]) -> Iterator[tuple[str, str]]:
    """``(qualified name, docstring)`` of each module and of its own public functions and classes."""
    for module_name in modules:
        module = importlib.import_module(module_name)
        doc = inspect.getdoc(module)
        if doc:
            yield module_name, doc
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj):
                doc = inspect.getdoc(obj)
                if doc:
                    yield f"{module_name}.{name}", doc


def chat_text(question: str, answer: str) -> str:
    """One exchange in the chat template's format, ending with the end-of-text token."""
    return f"{BOS}user\n{question}{EOS}\n{BOS}assistant\n{answer}{EOS}\n"


def training_documents(recipe: TrainingRecipe = DEFAULT_RECIPE) -> list[str]:
    """The training text: every prose paragraph as ``<s>...</s>``, then short question-and-answer chats.

    Paragraphs come from ``pydoc_data.topics`` and the docstrings of ``recipe.modules``; each chat
    asks about a topic or a documented name and answers with the first paragraph of its text, so
    the model learns to answer after ``<s>assistant`` and to end with ``</s>``.
    """
    documents: list[str] = []
    sources = [(title, text) for title, text in topic_texts().items()]
    sources += list(docstrings(recipe.modules))
    for name, text in sources:
        paragraphs = prose_paragraphs(text)
        documents += [f"{BOS}{paragraph}{EOS}" for paragraph in paragraphs]
        if not paragraphs or len(paragraphs[0].split()) > 60:
            continue
        if "." in name:  # a documented function or class
            question = f"What does {name} do?"
        elif name in recipe.modules:
            question = f"What is the {name} module?"
        else:
            heading = ascii_text(text).splitlines()[0].strip()
            question = f"Tell me about {heading[0].lower() + heading[1:]}."
        documents.append(chat_text(question, paragraphs[0]))
    return documents


def build_tokenizer(
    out_dir: Path, vocab_size: int = TOKENIZER_VOCAB, texts: Iterable[str] | None = None
) -> Any:
    """Train a byte-level BPE on ``texts`` (default: the shipped text); saved with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines() if texts is None else texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(
    out_dir: Path | str, *, seed: int = 0, tokenizer_vocab: int = TOKENIZER_VOCAB, **config: Any
) -> Path:
    """Write a random-weight Llama (``DEFAULT_CONFIG`` updated by ``config``) and its tokenizer to ``out_dir``."""
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("training the tokenizer on the shipped text")
    tokenizer = build_tokenizer(out, tokenizer_vocab)
    values = {**DEFAULT_CONFIG, **config}
    values.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    log.info(
        "building a random Llama: hidden %d, %d layers, vocab %d, seed %d",
        values["hidden_size"],
        values["num_hidden_layers"],
        values["vocab_size"],
        seed,
    )
    model_config = transformers.LlamaConfig(**values)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(model_config)
    with torch.no_grad():
        # Non-trivial norm weights, so a mis-loaded scale changes the output.
        for _name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.eval()
    model.save_pretrained(out)
    gen = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    gen.save_pretrained(out)
    (out / MARKER).write_text(
        json.dumps({"name": DEFAULT_MODEL_NAME, "version": BUILD_VERSION, "seed": seed})
    )
    return out


def starts_with_bos(tokenizer: Any, out_dir: Path) -> None:
    """Encode text as ``<s>`` + text (as documents began in training) and save; chats already hold ``<s>``."""
    from tokenizers import processors

    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.bos_token_id)]
    )
    tokenizer.save_pretrained(out_dir)


def train_threads() -> int:
    """The CPU threads training uses: this machine's cores, at most ``MAX_TRAIN_THREADS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_TRAIN_THREADS))


def _learning_rate(recipe: TrainingRecipe, step: int) -> float:
    """Linear warm-up, then a cosine down to ``min_lr_ratio`` of the peak."""
    if step < recipe.warmup_steps:
        return recipe.learning_rate * (step + 1) / recipe.warmup_steps
    done = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, done)))
    return recipe.learning_rate * (recipe.min_lr_ratio + (1.0 - recipe.min_lr_ratio) * cosine)


def train_model(
    out_dir: Path | str, recipe: TrainingRecipe = DEFAULT_RECIPE, *, progress: bool = True
) -> Path:
    """Train the tokenizer and a Llama of ``recipe.config`` on ``training_documents(recipe)``; write both.

    Plain torch on the CPU with deterministic algorithms, a fixed thread count and seeded data
    order, so the same recipe gives the same weights on the same machine.
    """
    import torch
    import transformers
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    documents = training_documents(recipe)
    random.Random(recipe.seed).shuffle(documents)
    plain = [re.sub(f"{re.escape(BOS)}|{re.escape(EOS)}", " ", doc) for doc in documents]
    log.info("training the tokenizer on %d documents of Python's own text", len(documents))
    tokenizer = build_tokenizer(out, recipe.vocab_size, plain)
    starts_with_bos(tokenizer, out)
    ids = [i for doc in documents for i in tokenizer(doc, add_special_tokens=False)["input_ids"]]
    stream = torch.tensor(ids, dtype=torch.long)
    window = recipe.seq_len + 1
    if len(stream) <= window:
        raise ValueError(f"the training text has {len(stream)} tokens, fewer than seq_len + 1 = {window}")

    values = {**recipe.config}
    values.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(train_threads())
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(recipe.seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**values))
        model.train()
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=recipe.weight_decay
        )
        order = torch.Generator().manual_seed(recipe.seed)
        offsets = torch.arange(window)
        bar = tqdm(
            range(recipe.steps),
            desc=f"qaic: training {DEFAULT_MODEL_NAME} ({len(stream)} tokens, first use only)",
            unit="step",
            disable=not progress,
        )
        for step in bar:
            starts = torch.randint(0, len(stream) - window, (recipe.batch_size,), generator=order)
            batch = stream[starts[:, None] + offsets]
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
            )
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(recipe, step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            bar.set_postfix(loss=f"{loss.item():.2f}", refresh=False)
        bar.close()
        final_loss = float(loss.item()) if recipe.steps else float("nan")
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    model.eval()
    model.save_pretrained(out)
    transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(out)
    marker = {
        "name": DEFAULT_MODEL_NAME,
        "version": BUILD_VERSION,
        "recipe": recipe.key(),
        "seed": recipe.seed,
        "steps": recipe.steps,
        "training_tokens": len(stream),
        "final_loss": round(final_loss, 4),
    }
    (out / MARKER).write_text(json.dumps(marker))
    return out


def ensure_default_model(directory: Path | None = None, recipe: TrainingRecipe = DEFAULT_RECIPE) -> Path:
    """The default model's directory, training it first when it is missing or from another recipe."""
    from filelock import FileLock

    target = Path(directory) if directory is not None else default_model_dir()
    if _is_current(target, recipe):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _is_current(target, recipe):
            return target
        log.info("training the default model %s in %s (first use only)", DEFAULT_MODEL_NAME, target)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
        try:
            train_model(tmp, recipe)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_current(path: Path, recipe: TrainingRecipe) -> bool:
    try:
        info = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return info.get("recipe") == recipe.key() and (path / "config.json").exists()
