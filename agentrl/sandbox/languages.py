"""The sandbox's languages, with SandboxFusion's names: how each is written, compiled and run inside a sandbox.

The host sends the launcher the commands of a run (``runtime/launcher.py`` knows no language but Python's
in-process fork): the source file's name, the compile command (run first, under its own limits) and the run
command. The toolchains are the sandbox's own (Debian packages under ``/usr``, read-only); every build output
and cache goes to the run's scratch (``/tmp``, emptied after the run). A toolchain missing from the sandbox is
reported before anything runs, naming the Debian package that provides it.

=============  ====================  =================================================  ==========================
name           Debian package        compile step (in /tmp)                             run
=============  ====================  =================================================  ==========================
python         python3               none                                               the launcher's interpreter
bash           bash                  none                                               bash main.sh
cpp            g++                   g++ -std=c++17 -O2 -o main main.cpp                ./main
c              gcc                   gcc -std=gnu17 -O2 -o main main.c -lm              ./main
java           default-jdk-headless  javac Main.java (the class is ``Main``)             java -Xmx<¾ memory> Main
go             golang-go             go build -o main main.go (CGO off)                 ./main
rust           rustc                 rustc -O --edition 2021 -o main main.rs            ./main
nodejs         nodejs                none                                               node main.js
typescript     node-typescript       types stripped by TypeScript (not checked, as      node main.js
                                     SandboxFusion's tsx): syntax errors fail it
=============  ====================  =================================================  ==========================

Differences from SandboxFusion, on purpose: C and C++ are built with ``-O2`` (as competitive-programming judges
do: a time limit means little at ``-O0``), Rust with ``-O``; ``c`` is a language of ours (SandboxFusion has none;
its client's ``Language`` type does not list it, so send it as raw JSON); a TypeScript syntax error is reported
in ``compile_result`` (SandboxFusion's tsx has no compile step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Transpile main.ts to main.js with TypeScript's own API: types are stripped, not checked (SandboxFusion runs
# TypeScript with tsx, which does the same); syntax errors are reported and fail the compile step.
_TS_TRANSPILE = r"""
const ts = require('typescript'), fs = require('fs');
const out = ts.transpileModule(fs.readFileSync('main.ts', 'utf8'), {fileName: 'main.ts', reportDiagnostics: true,
  compilerOptions: {target: ts.ScriptTarget.ES2020, module: ts.ModuleKind.CommonJS}});
const diags = out.diagnostics || [];
for (const d of diags) {
  const where = d.file && d.start !== undefined ? d.file.getLineAndCharacterOfPosition(d.start) : null;
  const pos = where ? `main.ts(${where.line + 1},${where.character + 1}): ` : '';
  console.error(pos + 'error TS' + d.code + ': ' + ts.flattenDiagnosticMessageText(d.messageText, '\n'));
}
if (diags.length) process.exit(1);
fs.writeFileSync('main.js', out.outputText);
"""
_JVM = ("-XX:+UseSerialGC", "-XX:-UsePerfData", "-XX:CompressedClassSpaceSize=64m",
        "-XX:ReservedCodeCacheSize=64m", "-XX:MaxMetaspaceSize=128m")


@dataclass(frozen=True, slots=True)
class Language:
    """How one language runs. ``run``/``compile`` are argv templates (``{heap_mb}``: the JVM's heap, from the
    step's memory limit); an empty ``run`` means Python in the launcher's own interpreter. ``tools`` must be on
    the sandbox's PATH (the first missing one is named, with ``package``). ``vm_reserve_mb``: address space the
    runtime reserves beyond what it uses, added to the address-space rlimit (a backstop; the memory cgroup is
    the real limit)."""

    name: str
    package: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    vm_reserve_mb: int = 0

    @property
    def compiled(self) -> bool:
        return bool(self.compile)

    def missing_hint(self, tool: str, backend: str = "local") -> str:
        """What to do when ``tool`` is missing from a ``backend`` sandbox (local: the host's /usr; docker: its image)."""
        how = (f"build the sandbox image with it: AGENTRL_SANDBOX_PACKAGES={self.package} "
               "scripts/build_sandbox_image.sh IMAGE" if backend == "docker" else
               f"apt-get install {self.package}, or scripts/install_system.sh --toolchains {self.name}")
        return (f"the sandbox has no {self.name} toolchain (`{tool}` is not on its PATH): install the Debian "
                f"package {self.package} ({how})")


LANGUAGE_TABLE: Mapping[str, Language] = MappingProxyType({lang.name: lang for lang in (
    Language("python", "python3", "main.py", ()),
    Language("bash", "bash", "main.sh", ("/bin/bash", "main.sh")),
    Language("cpp", "g++", "main.cpp", ("./main",), ("g++", "-std=c++17", "-O2", "-o", "main", "main.cpp"),
             tools=("g++", "as", "ld")),
    Language("c", "gcc", "main.c", ("./main",), ("gcc", "-std=gnu17", "-O2", "-o", "main", "main.c", "-lm"),
             tools=("gcc", "as", "ld")),
    Language("java", "default-jdk-headless", "Main.java",
             ("java", *_JVM, "-Xmx{heap_mb}m", "-ea", "-cp", ".", "Main"),
             ("javac", *(f"-J{o}" for o in _JVM), "-J-XX:TieredStopAtLevel=1", "-J-Xmx{heap_mb}m", "-encoding",
              "UTF-8", "Main.java"),
             tools=("javac", "java"), vm_reserve_mb=1024),
    Language("go", "golang-go", "main.go", ("./main",), ("go", "build", "-o", "main", "main.go"), tools=("go",),
             env=MappingProxyType({"GOCACHE": "/tmp/.cache/go-build", "GOPATH": "/tmp/go", "CGO_ENABLED": "0",
                                   "GO111MODULE": "off", "GOFLAGS": "-buildvcs=false", "GOTOOLCHAIN": "local"}),
             vm_reserve_mb=1024),
    Language("rust", "rustc", "main.rs", ("./main",), ("rustc", "-O", "--edition", "2021", "-o", "main", "main.rs"),
             tools=("rustc", "cc")),
    Language("nodejs", "nodejs", "main.js", ("node", "main.js"), tools=("node",), vm_reserve_mb=1024),
    Language("typescript", "node-typescript", "main.ts", ("node", "main.js"), ("node", "-e", _TS_TRANSPILE),
             tools=("node", "tsc"), env=MappingProxyType({"NODE_PATH": "/usr/share/nodejs:/usr/lib/nodejs"}),
             vm_reserve_mb=1024),
)})
LANGUAGES: tuple[str, ...] = tuple(LANGUAGE_TABLE)


def heap_mb(memory_mb: int) -> int:
    """The JVM's heap for a step's memory limit: three quarters of it (the rest is the JVM's own)."""
    return max(16, memory_mb * 3 // 4)
