"""
The console of train.py, eval.py, bench.py and reproduce.py: stdout and stderr wrapped so that printing never
stops a run. The algorithm does not need this module; it is standard library only, as reproduce.py, which runs
before any wheel is installed, needs.

What it guarantees (test_reliability.py's console tests, test_reproduce.py's ascii-console and `| head` tests):
- a write the console refuses (a closed `| head` or `| tee`, `> /dev/full`, a lost terminal, a stream closed with
  `>&-`) sends the rest of the output to os.devnull: the run goes on to its save (log.jsonl and reproduce.py's
  RUN.*.out logs keep every line);
- a character the console's encoding lacks (PYTHONIOENCODING=ascii, a non-UTF-8 locale) is written as an escape
  (\\xe9), as Python's stderr does, not a UnicodeEncodeError.
"""
import os


class Console:
    """stdout / stderr that outlive their reader (a killed reproduce.py, a closed `| tee`) and a console that
    cannot take them (`> /dev/full`, a lost terminal, `>&-`): after a failed write the output goes to
    os.devnull, so a print cannot stop the run before a SIGTERM's save (log.jsonl keeps every line). A
    character the console's encoding lacks (PYTHONIOENCODING=ascii, a non-UTF-8 locale; a path, the § of --help)
    is written as an escape (\\xe9), as Python's stderr does, not a UnicodeEncodeError."""

    def __init__(self, stream):
        if isinstance(stream, Console):  # wrapped again (`%run train.py` twice in one notebook): one layer, not two
            stream = stream.stream
        # None: started with the stream closed (>&-)
        self.stream = stream if stream is not None else open(os.devnull, "w", encoding="utf-8")
        if hasattr(self.stream, "reconfigure"):  # an undecodable path byte too: \udcff, not surrogateescape's byte
            self.stream.reconfigure(errors="backslashreplace")

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:  # BrokenPipeError, a full disk (ENOSPC), a hung-up terminal (EIO)
            self.stream = open(os.devnull, "w", encoding="utf-8")
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self.stream = open(os.devnull, "w", encoding="utf-8")

    def __getattr__(self, name):
        return getattr(self.stream, name)
