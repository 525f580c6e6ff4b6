"""
GLUE for eval.py: the task table (TASKS: each task's TSV columns, labels, metric and hub names; SUBMISSIONS:
the leaderboard files), read_tsv, a strict reader of the original TSVs, and load_task, which reads a task
from --glue_dir or from the hub's nyu-mll/glue. Pretraining does not need this module; eval.py's
fine-tuning loop sees only Datasets with text_a[, text_b] and label columns.

What it guarantees:
- a TSV row with the wrong number of columns, a label outside the task's set (an STS-B score outside
  [0, 5]), a missing column, or an empty or repeated test index is one ValueError naming file and line;
  the hub's label ids (RTE's 0/1, as a TSV exported from nyu-mll/glue holds them) are labels too;
  quoting is off (GLUE sentences hold bare quotes), except in a file re-saved with csv quoting
  (pandas' to_csv: every quote-holding cell wrapped, its own quotes doubled), which reads as the
  original, its added header line "0 1 2 3" (CoLA) dropped; a BOM, CRLF or CR line ends and empty lines
  are accepted;
  a TSV that cannot be read (permissions, a failing disk) is one ValueError naming it;
- a task whose files are absent or empty is TaskMissing (eval.py skips it and marks it missing), never a
  crash halfway through the other tasks; an absent test set is a reason string, not an error;
- an unreachable hub is one line naming the way out (--glue_dir).

Tests that hold it to this: test_eval.py (test_real_glue_tsvs, test_real_glue_quirks and
test_real_glue_test_sets on the GLUE files; test_error_malformed_rows,
test_a_header_without_a_needed_column_is_named_in_one_short_line,
test_a_test_set_index_must_be_unique_and_present, test_a_dev_set_without_rows_is_named,
test_a_test_set_without_rows_is_missing, test_an_unreadable_tsv_is_one_line,
test_a_tsv_resaved_with_csv_quoting_reads_as_the_original,
test_empty_lines_in_a_tsv_are_skipped_and_still_counted_in_error_lines,
test_the_hubs_label_ids_read_as_its_label_names, test_hub_unreachable_is_one_line).
"""
import os
import re
from dataclasses import dataclass, field

from corpus import quiet_hub, read_text


@dataclass(frozen=True)
class Task:
    name: str  # our name = the hub config name
    dir: str  # folder in the original GLUE distribution
    metric: str  # mcc | acc | f1_acc | corr
    tsv_text: tuple  # TSV column(s) holding sentence A (and B)
    tsv_label: str
    labels: dict = None  # TSV label -> id, the hub's numbering; None = regression (STS-B)
    hub_text: tuple = ()  # the hub's column names for sentence A (and B)
    dev: dict = field(default_factory=lambda: {"": ("dev", "validation")})  # suffix -> (TSV stem, hub split)
    header: tuple = None  # column names for a train/dev TSV without a header line (CoLA)
    test_index: str = "index"  # the test TSV's index column

    @property
    def label_ids(self):  # what read_tsv accepts: the TSV's labels, and the hub's ids that an export of it holds
        return {**{str(i): i for i in self.labels.values()}, **self.labels}

    @property
    def num_labels(self):
        return 1 if self.labels is None else len(set(self.labels.values()))


BINARY = {"0": 0, "1": 1}
NLI2 = {"entailment": 0, "not_entailment": 1}
TASKS = {t.name: t for t in [
    Task("cola", "CoLA", "mcc", ("sentence",), "label", BINARY, ("sentence",),
         header=("source", "label", "orig_label", "sentence")),
    Task("sst2", "SST-2", "acc", ("sentence",), "label", BINARY, ("sentence",)),
    Task("mrpc", "MRPC", "f1_acc", ("#1 String", "#2 String"), "Quality", BINARY, ("sentence1", "sentence2")),
    Task("stsb", "STS-B", "corr", ("sentence1", "sentence2"), "score", None, ("sentence1", "sentence2")),
    Task("qqp", "QQP", "f1_acc", ("question1", "question2"), "is_duplicate", BINARY, ("question1", "question2"),
         test_index="id"),
    Task("mnli", "MNLI", "acc", ("sentence1", "sentence2"), "gold_label",
         {"entailment": 0, "neutral": 1, "contradiction": 2}, ("premise", "hypothesis"),
         dev={"m": ("dev_matched", "validation_matched"), "mm": ("dev_mismatched", "validation_mismatched")}),
    Task("qnli", "QNLI", "acc", ("question", "sentence"), "label", NLI2, ("question", "sentence")),
    Task("rte", "RTE", "acc", ("sentence1", "sentence2"), "label", NLI2, ("sentence1", "sentence2")),
    Task("wnli", "WNLI", "acc", ("sentence1", "sentence2"), "label", BINARY, ("sentence1", "sentence2")),
]}

# GLUE leaderboard files (--predict): file stem -> (task whose model predicts it, test TSV under
# --glue_dir, hub config, hub split). The diagnostic set AX is predicted by the MNLI model.
SUBMISSIONS = {
    "CoLA": ("cola", "CoLA/test.tsv", "cola", "test"),
    "SST-2": ("sst2", "SST-2/test.tsv", "sst2", "test"),
    "MRPC": ("mrpc", "MRPC/test.tsv", "mrpc", "test"),
    "STS-B": ("stsb", "STS-B/test.tsv", "stsb", "test"),
    "QQP": ("qqp", "QQP/test.tsv", "qqp", "test"),
    "MNLI-m": ("mnli", "MNLI/test_matched.tsv", "mnli", "test_matched"),
    "MNLI-mm": ("mnli", "MNLI/test_mismatched.tsv", "mnli", "test_mismatched"),
    "QNLI": ("qnli", "QNLI/test.tsv", "qnli", "test"),
    "RTE": ("rte", "RTE/test.tsv", "rte", "test"),
    "WNLI": ("wnli", "WNLI/test.tsv", "wnli", "test"),
    "AX": ("mnli", "diagnostic/diagnostic.tsv", "ax", "test"),
}


CSV_QUOTED = re.compile(r'"(?:[^"]|"")*"')  # a cell as csv quotes it: wrapped in quotes, its own doubled


class TaskMissing(Exception):
    """A task's data is not there: it is skipped and marked missing."""


def read_tsv(path, task, test=False):
    """One GLUE TSV as a Dataset(text_a[, text_b], label); a test TSV (no labels) as
    Dataset(text_a[, text_b], index). Quoting is off: GLUE sentences hold bare quotes (a file
    re-saved with csv quoting is unquoted). utf-8-sig drops MRPC's BOM. Every row must have the
    header's column count."""
    import datasets  # imported here, as in corpus.load_corpus: it costs ~2 s
    try:
        text = read_text(path)
    except OSError as e:  # a file this user may not read, a failing disk: one line, not a traceback
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # LF, CRLF or CR, as open() reads
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line]  # empty lines skipped, as pandas skips them
    if not any(line.strip() for line in lines):  # an empty file has no rows (load_task: the task is missing)
        columns = ("text_a", "text_b")[:len(task.tsv_text)] + ("index" if test else "label",)
        return datasets.Dataset.from_dict({c: [] for c in columns})
    if task.header and not test:  # CoLA's train/dev have no header line, its test file has one
        pandas = numbered[0][1] == "\t".join(map(str, range(len(task.header))))  # to_csv's "0 1 2 3", not a row
        header, first = task.header, int(pandas)
    else:
        header, first = numbered[0][1].split("\t"), 1
    col = {name: i for i, name in enumerate(header)}
    target = task.test_index if test else task.tsv_label
    lacking = [c for c in task.tsv_text + (target,) if c not in col]
    if lacking:  # the header shown cut short: a file of one long line (not a TSV at all) is all header
        shown = str(header) if len(str(header)) <= 200 else str(header)[:200] + " ..."
        raise ValueError(f"{path}: no column {lacking[0]!r} in the header {shown}")
    table = [(n, line.split("\t")) for n, line in numbered[first:]]
    # re-saved by pandas' to_csv (csv quoting), every cell holding a quote is wrapped in quotes, its own doubled
    # ('"a ""b"""'); most of GLUE's own (bare) quoted cells are not of that form, and none holds a ""
    quoted = [cell for _, cells in table for cell in cells if '"' in cell]
    if quoted and all(CSV_QUOTED.fullmatch(c) for c in quoted) and any('""' in c[1:-1] for c in quoted):
        table = [(n, [c[1:-1].replace('""', '"') if '"' in c else c for c in cells]) for n, cells in table]
    rows, seen = {"text_a": [], "text_b": [], "index" if test else "label": []}, set()
    for lineno, cells in table:
        if len(cells) != len(header):
            raise ValueError(f"{path}:{lineno}: expected {len(header)} tab-separated columns, got {len(cells)}")
        raw = cells[col[target]]
        if test:
            if not raw.strip() or raw in seen:  # the leaderboard matches predictions to rows by index
                raise ValueError(f"{path}:{lineno}: {'an empty' if not raw.strip() else 'a repeated'} index {raw!r}")
            seen.add(raw)
            rows["index"].append(raw)
        else:
            try:
                label = float(raw) if task.labels is None else task.label_ids[raw]
                if not 0 <= label <= 5:  # STS-B's similarity scale (NaN fails too); class ids pass
                    raise ValueError
                rows["label"].append(label)
            except (KeyError, ValueError):
                expected = "a number in [0, 5]" if task.labels is None else "/".join(task.label_ids)
                raise ValueError(f"{path}:{lineno}: bad label {raw!r} (expected {expected})") from None
        for key, name in zip(("text_a", "text_b"), task.tsv_text):
            rows[key].append(cells[col[name]])
    if len(task.tsv_text) == 1:
        del rows["text_b"]
    return datasets.Dataset.from_dict(rows)


def load_hub(config):
    """All splits of nyu-mll/glue's `config`. Failing to reach the hub is one line with the way out."""
    import datasets
    try:
        with quiet_hub():
            return datasets.load_dataset("nyu-mll/glue", config)
    except Exception as e:  # offline (ConnectionError), or a broken cache: every task would fail alike
        reason = (str(e).splitlines() or [""])[0][:160]
        raise ValueError(f"GLUE from the hub (nyu-mll/glue, {config}) is not reachable ({type(e).__name__}: "
                         f"{reason}); without internet, download the GLUE data (download_glue_data.py) and "
                         "pass --glue_dir DIR, the folder holding CoLA/, SST-2/, ...") from None


def load_task(task, glue_dir=None, test=False):
    """{"train": Dataset, "dev": {suffix: Dataset}} from the GLUE TSVs in glue_dir, else from the hub.
    test=True adds "test": {submission stem: Dataset(text_a[, text_b], index), or a str saying why
    that test set is absent}."""
    tests = {stem: spec[1:] for stem, spec in SUBMISSIONS.items() if spec[0] == task.name} if test else {}
    if glue_dir:
        files = {"train": "train", **{suffix: stem for suffix, (stem, _) in task.dev.items()}}
        paths = {k: os.path.join(glue_dir, task.dir, stem + ".tsv") for k, stem in files.items()}
        absent = [os.path.relpath(p, glue_dir) for p in paths.values() if not os.path.isfile(p)]
        if absent:
            raise TaskMissing(f"no {', '.join(absent)} in {glue_dir}")
        splits = {k: read_tsv(p, task) for k, p in paths.items()}
        test_sets = {}
        for stem, (rel, _, _) in tests.items():
            path = os.path.join(glue_dir, rel)
            if not os.path.isfile(path):
                test_sets[stem] = f"no {rel} in {glue_dir}"
                continue
            ds = read_tsv(path, task, test=True)
            test_sets[stem] = ds if len(ds) else f"{rel} in {glue_dir} has no rows"
    else:  # needs internet (or the hub cache) and is never exercised by the tests
        hub = {task.name: load_hub(task.name)}
        names = dict(zip(task.hub_text, ("text_a", "text_b")))
        splits = {"train": hub[task.name]["train"],
                  **{suffix: hub[task.name][split] for suffix, (_, split) in task.dev.items()}}
        splits = {k: ds.select_columns([*names, "label"]).rename_columns(names) for k, ds in splits.items()}
        test_sets = {}
        for stem, (_, config, split) in tests.items():
            if config not in hub:
                hub[config] = load_hub(config)
            ds = hub[config][split]
            test_sets[stem] = ds.select_columns([*names, "idx"]).rename_columns({**names, "idx": "index"})
    empty = [k for k, ds in splits.items() if len(ds) == 0]
    if empty:
        stem = "train" if empty[0] == "train" else task.dev[empty[0]][0]  # "" -> dev, "m" -> dev_matched
        raise TaskMissing(f"the {stem} split has no rows")
    return {"train": splits.pop("train"), "dev": splits, **({"test": test_sets} if test else {})}
