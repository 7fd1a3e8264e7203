"""One program per outcome in every sandbox language, and how to tell whether a language's toolchain is here.

``hello`` prints ``hello``; ``compile_error`` does not compile (a syntax error for the interpreted languages);
``runtime_error`` compiles and then fails (non-zero exit); ``loop`` never ends; ``stdin`` reads two integers
and prints their sum.
"""

from __future__ import annotations

import shutil

import pytest

from agentrl.sandbox.languages import LANGUAGE_TABLE

SANDBOX_PATH = "/usr/bin:/bin"  # what the local sandbox sees (/usr read-only; /usr/local hidden)

PROGRAMS: dict[str, dict[str, str]] = {
    "python": {
        "hello": "print('hello')",
        "compile_error": "def f(:\n    pass",
        "runtime_error": "raise ValueError('boom')",
        "loop": "while True: pass",
        "stdin": "a, b = map(int, input().split())\nprint(a + b)",
    },
    "bash": {
        "hello": "echo hello",
        "compile_error": "if then fi (",
        "runtime_error": "echo boom >&2; exit 3",
        "loop": "while true; do :; done",
        "stdin": "read a b; echo $((a + b))",
    },
    "cpp": {
        "hello": '#include <iostream>\nint main() { std::cout << "hello" << std::endl; return 0; }',
        "compile_error": "#include <iostream>\nint main() { std::cout << undeclared_name; }",
        "runtime_error": "#include <vector>\n#include <stdexcept>\n"
                         "int main() { std::vector<int> v; return v.at(3); }",
        "loop": "int main() { volatile unsigned long x = 0; while (true) { x++; } }",
        "stdin": "#include <iostream>\nint main() { long a, b; std::cin >> a >> b; std::cout << a + b << '\\n'; }",
    },
    "c": {
        "hello": '#include <stdio.h>\nint main(void) { puts("hello"); return 0; }',
        "compile_error": "int main(void) { return undeclared_name; }",
        "runtime_error": '#include <stdlib.h>\nint main(void) { abort(); }',
        "loop": "int main(void) { volatile unsigned long x = 0; for (;;) x++; }",
        "stdin": '#include <stdio.h>\nint main(void) { long a, b; scanf("%ld %ld", &a, &b); '
                 'printf("%ld\\n", a + b); return 0; }',
    },
    "java": {
        "hello": 'public class Main { public static void main(String[] a) { System.out.println("hello"); } }',
        "compile_error": "public class Main { public static void main(String[] a) { int x = \"s\"; } }",
        "runtime_error": "public class Main { public static void main(String[] a) { "
                         "throw new RuntimeException(\"boom\"); } }",
        "loop": "public class Main { public static void main(String[] a) { long x = 0; while (true) { x++; } } }",
        "stdin": "import java.util.*;\npublic class Main { public static void main(String[] a) { "
                 "Scanner s = new Scanner(System.in); System.out.println(s.nextLong() + s.nextLong()); } }",
    },
    "go": {
        "hello": 'package main\nimport "fmt"\nfunc main() { fmt.Println("hello") }',
        "compile_error": 'package main\nfunc main() { x := undeclaredName }',
        "runtime_error": 'package main\nfunc main() { var a []int; _ = a[3] }',
        "loop": "package main\nfunc main() { x := 0; for { x++ } }",
        "stdin": 'package main\nimport "fmt"\nfunc main() { var a, b int64; fmt.Scan(&a, &b); fmt.Println(a + b) }',
    },
    "rust": {
        "hello": 'fn main() { println!("hello"); }',
        "compile_error": "fn main() { let x: i32 = \"s\"; }",
        "runtime_error": 'fn main() { let v: Vec<i32> = Vec::new(); let i = std::env::args().count() + 2; '
                         'println!("{}", v[i]); }',
        "loop": "fn main() { let mut x: u64 = 0; loop { x = x.wrapping_add(std::env::args().count() as u64); "
                "if x == 7 { println!(\"{}\", x); } } }",
        "stdin": "use std::io::Read;\nfn main() { let mut s = String::new(); "
                 "std::io::stdin().read_to_string(&mut s).unwrap(); "
                 "let v: Vec<i64> = s.split_whitespace().map(|t| t.parse().unwrap()).collect(); "
                 'println!("{}", v[0] + v[1]); }',
    },
    "nodejs": {
        "hello": "console.log('hello');",
        "compile_error": "function f( {",
        "runtime_error": "throw new Error('boom');",
        "loop": "for (;;) {}",
        "stdin": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
                 "console.log(a + b);",
    },
    "typescript": {
        "hello": "const greeting: string = 'hello';\nconsole.log(greeting);",
        "compile_error": "const x: number = ;\nfunction (",
        "runtime_error": "function boom(): never { throw new Error('boom'); }\nboom();",
        "loop": "let x: number = 0;\nfor (;;) { x++; }",
        "stdin": "const [a, b]: number[] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
                 "console.log(a + b);",
    },
}
COMPILED = tuple(name for name, lang in LANGUAGE_TABLE.items() if lang.compiled)


def missing_toolchain(language: str) -> str | None:
    """Why ``language`` cannot run in the local sandbox here (a tool missing from its PATH), or None."""
    lang = LANGUAGE_TABLE[language]
    for tool in lang.tools:
        if shutil.which(tool, path=SANDBOX_PATH) is None:
            return f"{language}: `{tool}` is not installed (Debian package {lang.package})"
    return None


#: languages every machine that runs the tests has (scripts/install_system.sh's test profile, the Docker image):
#: missing, their tests fail (saying which package is missing) instead of skipping
REQUIRED = ("python", "bash", "cpp", "nodejs")


def language_param(language: str) -> object:
    """A pytest param that skips, naming the Debian package, when the toolchain is not installed (never for the
    ``REQUIRED`` languages: their tests run, and fail with the sandbox's message naming the package)."""
    why = None if language in REQUIRED else missing_toolchain(language)
    return pytest.param(language, marks=pytest.mark.skipif(why is not None, reason=why or ""))
