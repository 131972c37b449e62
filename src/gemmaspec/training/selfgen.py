"""Self-generated drafter data at scale: many varied requests, continued by the target in batches,
with the teacher signals recorded during generation (no second target forward).

Prompts (:func:`generated_prompts`) are built programmatically from templates × topics written for
gemmaspec, and from pieces of the running interpreter's standard-library sources and ``pydoc`` topics
(Python Software Foundation License 2.0) used as material ("continue this code", "explain", "summarise").
About half are sent as Gemma chat turns (``tokenizer.encode_chat``, as users send requests), the rest
as raw text. Any prompt overlapping a held-out prompt (:func:`~.corpus.held_out_texts`) is dropped,
and :func:`generate_chunks` refuses one that is left.

:func:`generate_chunks` continues them with the target, ``batch`` sequences per forward
(``forward_batch``), greedy or (a seeded fraction) sampled at a temperature, and writes one teacher
chunk (:class:`~.teacher.Chunk`) per prompt: for every position fed to the target, its final-norm
hidden state, the K/V its cache holds for the two layers the assistant reads, and its top-8
log-probabilities, exactly what :func:`~.teacher.teacher_chunk` would compute over the same tokens
(up to the kernels' batch rounding). Files are written per prompt, atomically, so an interrupted run
resumes at the first missing one.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from pathlib import Path

import torch

from .teacher import TOP_K, Chunk

LANGS = ["Python", "JavaScript", "TypeScript", "C", "C++", "Go", "Rust", "Java", "Bash", "Ruby", "C#", "PHP"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a string",
    "returns the largest element of a list", "merges two dictionaries", "flattens a nested list",
    "computes the factorial of n", "removes duplicates from a list while keeping the order",
    "converts Celsius to Fahrenheit", "finds the longest word in a sentence", "checks if a string is a palindrome",
    "sums the digits of an integer", "reads a text file and counts its lines", "returns the n-th Fibonacci number",
    "validates an email address", "sorts a list of people by age", "computes the average of a list of numbers",
    "groups words by their first letter", "returns the intersection of two lists", "generates a random password",
    "converts a Roman numeral to an integer", "finds the greatest common divisor of two numbers",
    "capitalizes the first letter of every word", "counts how often each word occurs in a text",
    "rotates a list by k positions", "checks whether two strings are anagrams", "implements a simple stack",
    "implements a queue with two stacks", "computes the dot product of two vectors", "transposes a matrix",
    "parses a date string in the format YYYY-MM-DD", "retries a function call three times on failure",
    "downloads a web page and prints its title", "walks a directory tree and lists all files",
    "finds the second smallest number in a list", "converts a number to binary", "chunks a list into pieces of size n",
    "implements binary search", "implements bubble sort", "computes the median of a list",
    "caches the results of an expensive function", "measures how long a function takes to run",
]
CODE_ASKS = ["Write a {lang} function that {task}.", "Write a {lang} program that {task}, with comments.",
             "In {lang}, write a function that {task}. Then show an example call.",
             "Show me how to write a function that {task} in {lang}.",
             "Write a {lang} function that {task} and explain how it works."]
SQL_TASKS = ["lists all employees hired after 2020", "counts the orders per month",
             "finds the products that were never ordered", "returns the average salary per department",
             "deletes users who have not logged in for a year", "joins the authors and books tables",
             "finds duplicate email addresses", "returns the three most expensive products in each category"]
THINGS = ["a movie", "a car", "a city", "a recipe", "a laptop", "a student", "a song", "a hotel", "a flight",
          "a restaurant", "an employee", "a planet", "a country", "a video game", "a podcast", "a museum",
          "a bicycle", "a smartphone", "a football team", "a painting"]
FIELDS = ["name, year and rating", "title, price and tags (a list)", "id, owner, created_at and status",
          "name, population, country and landmarks (a list)", "brand, model, year and features (a list)",
          "first_name, last_name, email and skills (a list)"]
PEOPLE = [("Maria", 34, "Lisbon"), ("Tom", 52, "Dublin"), ("Yuki", 27, "Osaka"), ("Omar", 41, "Cairo"),
          ("Lena", 19, "Vienna"), ("Raj", 38, "Pune"), ("Sofia", 23, "Athens"), ("Pedro", 60, "Lima"),
          ("Ines", 45, "Porto"), ("Jonas", 31, "Bergen"), ("Chen", 29, "Taipei"), ("Ada", 36, "Lagos")]
LIST_ASKS = ["List {n} {x}.", "Give me {n} {x}.", "Name {n} {x}, one per line.", "Make a numbered list of {n} {x}."]
LIST_TOPICS = ["healthy breakfast ideas", "famous scientists and what they discovered", "ways to save energy at home",
               "tips for writing clean code", "countries in South America", "board games for families",
               "reasons to learn a second language", "common mistakes in job interviews", "birds that live in cities",
               "programming languages and what they are used for", "things to pack for a camping trip",
               "ways to reduce stress", "inventions of the 20th century", "vegetables that grow in shade",
               "exercises you can do without equipment", "questions to ask a new doctor",
               "features of a good password", "uses of baking soda", "books for young readers",
               "habits of productive people"]
QUESTIONS = [
    "What is photosynthesis?", "How do airplanes stay in the air?", "Why do cats purr?", "What is inflation?",
    "How does the internet work?", "What is a black hole?", "Why do leaves change color in autumn?",
    "How do vaccines get tested?", "What is machine learning?", "Why is the ocean salty?",
    "How does a battery store energy?", "What causes earthquakes?", "What is the difference between a virus and a bacterium?",
    "How does GPS know where I am?", "Why do we dream?", "What is a prime number?", "How are rainbows formed?",
    "What does DNA do?", "Why do onions make you cry?", "How does compound interest work?",
    "What is the speed of light?", "Why do we have time zones?", "How do bees make honey?",
    "What is a recursive function?", "How does a compiler work?", "What is an API?", "Why do stars twinkle?",
    "How does the heart pump blood?", "What is democracy?", "What were the causes of the French Revolution?",
    "How do plants know which way is up?", "What is the greenhouse effect?", "How does a microwave heat food?",
    "What is the difference between RAM and storage?", "Why is exercise good for the brain?",
    "How are mountains formed?", "What is a hash table?", "How does encryption keep data safe?",
    "What is the theory of evolution?", "Why does the moon have phases?",
]
QA_FORMS = ["Question: {q}\nAnswer:", "Q: {q}\nA:", "{q}", "{q} Explain briefly.", "Answer in simple words: {q}"]
STORY_WHO = ["a young baker", "an old sailor", "a curious cat", "a retired teacher", "a girl who cannot sleep",
             "a dragon afraid of fire", "a detective in a small town", "two brothers", "a gardener on Mars",
             "a lost dog", "a musician without an instrument", "a clockmaker", "a child and her grandfather",
             "an astronaut", "a fisherman", "a shy librarian"]
STORY_WHAT = ["finds a hidden door", "wins a strange contest", "travels back in time for one day",
              "must deliver a secret letter", "makes an unexpected friend", "gets lost in a big city",
              "discovers a talent for singing", "opens a shop by the sea", "builds a machine that talks",
              "receives a gift from a stranger"]
STORY_ASKS = ["Write a short story about {who} who {what}.", "Tell me a story about {who} who {what}.",
              "Write the opening paragraph of a novel about {who} who {what}.",
              "Write a children's story about {who} who {what}."]
SCENES = ["a busy market in the morning", "a quiet library at night", "a storm at sea", "a mountain village in winter",
          "a train station at rush hour", "a beach at sunset", "a kitchen before a big dinner", "an empty stadium",
          "a city after the rain", "a desert at noon", "a school on the first day", "a garden in spring"]
SENTENCES = ["Where is the nearest train station?", "I would like a cup of coffee, please.",
             "The meeting has been moved to Thursday.", "Thank you very much for your help.",
             "How much does this cost?", "We are going to the museum tomorrow.", "My brother lives in a small town.",
             "Please close the window, it is cold.", "The book is on the table.", "I have been learning to cook."]
TARGET_LANGS = ["French", "German", "Spanish", "Italian", "Portuguese", "Dutch"]
WRITING = ["Write an email to my landlord about a broken heater.", "Write a thank-you note to a teacher.",
           "Write a product description for a reusable water bottle.", "Write a short speech for a friend's wedding.",
           "Write a cover letter for a junior developer position.", "Write a poem about the city at night.",
           "Write a limerick about a programmer.", "Write a review of an imaginary restaurant.",
           "Write instructions for making a paper airplane.", "Write a weekly meal plan for a vegetarian.",
           "Write a README introduction for a command-line tool that renames files.",
           "Write a commit message for a change that fixes a crash on empty input.",
           "Write a short biography of a fictional inventor.", "Write a dialogue between a customer and a waiter.",
           "Give me a packing list for a weekend trip.", "Explain recursion to a ten-year-old.",
           "Explain the rules of chess in a few paragraphs.", "Compare trains and planes for a 500 km trip.",
           "What are the pros and cons of working from home?", "Describe how to change a flat tire, step by step."]
NAMES = ["sun", "river", "stone", "apple", "window", "paper", "green tea", "blue car", "old map", "tiny bird"]


def _stdlib_pieces(limit: int, rng: random.Random) -> list[str]:
    """Code pieces (a few whole lines, 300–900 characters) from the standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 3000)
    out = []
    for p in rng.sample(files, min(len(files), limit)):
        text = p.read_text(errors="replace")
        lines = text.splitlines(keepends=True)
        at = rng.randrange(max(1, len(lines) - 40))
        piece = "".join(lines[at:at + 30])[:rng.randint(300, 900)]
        piece = piece[:piece.rfind("\n") + 1] if "\n" in piece else piece
        if len(piece) > 120:
            out.append(piece)
    return out


def _pydoc_pieces(limit: int, rng: random.Random) -> list[str]:
    import pydoc_data.topics as t

    keys = sorted(t.topics)
    out = []
    for key in rng.sample(keys, min(len(keys), limit)):
        text = t.topics[key]
        at = rng.randrange(max(1, len(text) - 800))
        piece = text[at:at + 600]
        piece = piece[piece.find(" ") + 1:piece.rfind(".") + 1] if "." in piece else piece
        if len(piece) > 150:
            out.append(piece.strip())
    return out


def generated_prompts(n: int, seed: int = 0, held: list[str] | None = None) -> list[dict]:
    """``n`` varied requests (deterministic in ``seed``): ``{"kind", "text", "chat"}`` each, ``chat``
    True for about half (sent as a user turn of the chat template). Prompts that contain, or are
    contained in, a held-out prompt are dropped.

    Kinds: code, sql, code-continue, code-explain, json, list, qa, story, describe, translate,
    summary, rewrite, writing.
    """
    rng = random.Random(seed)
    pool = []
    for lang in LANGS:
        for task in CODE_TASKS:
            pool.append(("code", rng.choice(CODE_ASKS).format(lang=lang, task=task)))
    for task in SQL_TASKS:
        pool.append(("sql", f"Write a SQL query that {task}."))
        pool.append(("sql", f"Write a SQL query that {task}, then explain it."))
    for piece in _stdlib_pieces(160, rng):
        pool.append(("code-continue", piece))
        pool.append(("code-explain", rng.choice(["Explain what this code does:\n", "Add comments to this code:\n",
                                                  "Find possible bugs in this code:\n"]) + "```python\n"
                     + piece[:500] + "```\n"))
    for thing in THINGS:
        for fields in rng.sample(FIELDS, 2):
            pool.append(("json", f"Write a JSON object describing {thing} with the fields {fields}."))
    for i in range(60):
        a, b, c = rng.sample(PEOPLE, 3)
        pool.append(("json", f"Convert to JSON: name {a[0]}, age {a[1]}, city {a[2]}.\n"
                             f'{{"name": "{a[0]}", "age": {a[1]}, "city": "{a[2]}"}}\n'
                             f"Convert to JSON: name {b[0]}, age {b[1]}, city {b[2]}.\n"))
        rows = "".join(f"{p[0]} | {p[1]} | {p[2]}\n" for p in rng.sample(PEOPLE, rng.randint(3, 5)))
        pool.append(("json", "Convert this table to a JSON array of objects:\nname | age | city\n" + rows + "JSON:\n"))
    for topic in LIST_TOPICS:
        for _ in range(2):
            pool.append(("list", rng.choice(LIST_ASKS).format(n=rng.choice([3, 5, 7, 10]), x=topic)))
    for q in QUESTIONS:
        for form in rng.sample(QA_FORMS, 3):
            pool.append(("qa", form.format(q=q)))
    for who in STORY_WHO:
        for what in rng.sample(STORY_WHAT, 3):
            pool.append(("story", rng.choice(STORY_ASKS).format(who=who, what=what)))
    for scene in SCENES:
        pool.append(("describe", f"Describe {scene}."))
        pool.append(("describe", f"Write a paragraph describing {scene}."))
    for s in SENTENCES:
        for lang in rng.sample(TARGET_LANGS, 3):
            pool.append(("translate", f"Translate to {lang}: {s}"))
    for piece in _pydoc_pieces(120, rng):
        pool.append(("summary", rng.choice(["Summarize the following text in two sentences:\n",
                                            "Explain this in simpler words:\n", "What is this text about?\n"])
                     + piece + "\n"))
    for i in range(40):
        words = rng.sample(NAMES, rng.randint(4, 8))
        items = "".join(f"item {j}: the {w} is {rng.choice(['red', 'large', 'quiet', 'new', 'far away'])}\n"
                        for j, w in enumerate(words, 1))
        pool.append(("rewrite", rng.choice(["Repeat this list exactly:\n", "Copy the following lines, numbering them:\n",
                                            "Rewrite each line in upper case:\n"]) + items))
    for w in WRITING:
        pool.append(("writing", w))
    held = held or []
    pool = [(k, t) for k, t in pool if not any(t.strip() in h or h.strip() in t for h in held if h.strip())]
    rng.shuffle(pool)
    out = []
    for i in range(n):
        kind, text = pool[i % len(pool)]
        # a prompt used twice is sent once raw and once as chat (and, by the sampling fraction, often sampled)
        chat = (rng.random() < 0.5) if i < len(pool) else not out[i - len(pool)]["chat"]
        if kind == "code-continue":
            chat = chat and i >= len(pool)  # raw code first: what "continue this code" is
        out.append({"kind": kind, "text": text, "chat": bool(chat)})
    return out


def prompt_ids(tokenizer, p: dict) -> list[int]:
    if p["chat"]:
        return tokenizer.encode_chat([{"role": "user", "content": p["text"]}])
    return tokenizer.encode(p["text"])


def _signals(logits: torch.Tensor):
    lp = torch.log_softmax(logits.float(), dim=-1)
    v, ix = torch.topk(lp, TOP_K, dim=-1)
    return ix.to(torch.int32), v.to(torch.float16)


@torch.inference_mode()
def generate_chunks(model, tokenizer, prompts: list[dict], out_dir: Path, length: int = 256, batch: int = 16,
                    sample_frac: float = 0.33, temperature: float = 0.8, seed: int = 0, max_prompt: int = 160,
                    held: list[str] | None = None, progress=None) -> list[Path]:
    """Continue every prompt with the target and write its teacher chunk ``out_dir/gen-NNNNNN.pt``
    (prompt + continuation, at most ``length`` tokens, ending early at EOS or end of turn), skipping files already
    there. Prompt ``i`` is sampled at ``temperature`` when a ``seed``-seeded draw says so (a
    ``sample_frac`` fraction), greedy otherwise.

    Returns:
        The chunk files, in prompt order (prompts longer than ``max_prompt`` or ``length`` - 32 tokens are skipped).

    Raises:
        ValueError: a prompt overlaps a held-out prompt (``held``).
    """
    for p in prompts:
        t = p["text"].strip()
        if any(t in h or h.strip() in t for h in held or [] if h.strip()):
            raise ValueError(f"a self-generation prompt overlaps a held-out prompt: {t[:60]!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    temps = [temperature if rng.random() < sample_frac else 0.0 for _ in prompts]
    todo = []
    for i, p in enumerate(prompts):
        ids = prompt_ids(tokenizer, p)
        if len(ids) <= min(max_prompt, length - 32):
            todo.append((i, ids))
    paths = [out_dir / f"gen-{i:06d}.pt" for i, _ in todo]
    layout = model.kv_layout()
    eos = {tokenizer.eos_id}
    eot = tokenizer.token_to_id("<end_of_turn>")
    if eot is not None:
        eos.add(eot)
    done = 0
    for g in range(0, len(todo), batch):
        group = [(i, ids) for i, ids in todo[g:g + batch] if not (out_dir / f"gen-{i:06d}.pt").exists()]
        if group:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + group[0][0])

            def pick(i, logits):
                if temps[i] > 0:
                    probs = torch.softmax(logits.float() / temps[i], dim=-1)
                    return int(torch.multinomial(probs, 1, generator=gen))
                return int(logits.argmax())

            caches = [model.new_cache(length + 1, ring=False) for _ in group]
            seqs, hid, tid, tlp, nxt = [], [], [], [], []
            for (i, ids), cache in zip(group, caches):
                o = model.forward(torch.tensor(ids), cache, all_logits=True)
                a, b = _signals(o.logits)
                seqs.append(list(ids))
                hid.append([o.hidden.to(torch.float16)])
                tid.append([a])
                tlp.append([b])
                nxt.append(pick(i, o.logits[-1]))
            # a sequence feeds its next token while it has room and has not ended; every fed position
            # gets its signals, the last sampled token (never fed) is dropped
            alive = [nxt[j] not in eos and len(seqs[j]) < length for j in range(len(group))]
            while any(alive):
                idx = [j for j in range(len(group)) if alive[j]]
                outs = model.forward_batch([(torch.tensor([nxt[j]]), caches[j]) for j in idx])
                for j, o in zip(idx, outs):
                    seqs[j].append(nxt[j])
                    a, b = _signals(o.logits)
                    hid[j].append(o.hidden.to(torch.float16))
                    tid[j].append(a)
                    tlp[j].append(b)
                    nxt[j] = pick(group[j][0], o.logits[-1])
                    alive[j] = nxt[j] not in eos and len(seqs[j]) < length
            for j, (i, _) in enumerate(group):
                n = len(seqs[j])
                kv = {kind: (caches[j].layers[layer].k[:n].to(torch.float16).clone(),
                             caches[j].layers[layer].v[:n].to(torch.float16).clone())
                      for kind, (layer, _, _) in layout.items()}
                Chunk(torch.tensor(seqs[j], dtype=torch.int64), torch.cat(hid[j]), kv, torch.cat(tid[j]),
                      torch.cat(tlp[j])).save(out_dir / f"gen-{i:06d}.pt")
        done += len(todo[g:g + batch])
        if progress is not None:
            progress(done, len(todo))
    return paths


def selfgen_dir(target_dir: Path, seed: int, length: int, sample_frac: float, temperature: float) -> Path:
    """``target_dir/selfgen-<key>``: the key hashes the prompt generator's output (its first 2,000
    prompts) and the generation settings, not the number of prompts, so a larger ``--self-prompts``
    reuses every chunk a smaller one wrote (prompts and sampling draws are prefix-stable)."""
    spec = {"prompts": generated_prompts(2000, seed), "seed": seed, "length": length, "sample_frac": sample_frac,
            "temperature": temperature, "top_k": TOP_K}
    return Path(target_dir) / ("selfgen-" + hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16])
