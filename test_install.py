"""The install a user follows is the one CI tests: requirements.txt's ranges admit the versions
pinned in constraints.txt (what CI last passed with), and .ci/run runs the README's full test
command in a virtual environment of its own."""
import os
import re

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

HERE = os.path.dirname(os.path.abspath(__file__))


def read(name):
    with open(os.path.join(HERE, name)) as f:
        return f.read()


def requirement_lines(text):
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def test_every_requirement_is_pinned_in_constraints_within_its_range():
    pins = {}
    for line in requirement_lines(read("constraints.txt")):
        name, sep, version = line.partition("==")
        assert sep and version, f"constraints.txt: {line!r} is not an exact pin (name==version)"
        pins[canonicalize_name(name)] = Version(version)
    for line in requirement_lines(read("requirements.txt")):
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"requirements.txt asks for {req.name}, which constraints.txt does not pin"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside requirements.txt's {req}"


def test_ci_builds_its_own_environment_and_runs_the_readmes_full_command():
    ci, readme = read(".ci/run"), read("README.md")
    assert "python -m pytest -q --slow" in readme and '"$py" -m pytest -q --slow' in ci
    assert re.search(r"-m venv", ci) and "-c constraints.txt" in ci
    assert "pip install -r requirements.txt -c constraints.txt" in readme
