import pytest

from agentrl.env.retool import format_interpreter, parse_code_call, render_run_output


def test_complete_call():
    call = parse_code_call("Let me compute.\n<code>\nprint(17 * 23)\n</code>")
    assert call is not None and call.error is None
    assert call.code == "print(17 * 23)"
    assert call.raw == "<code>\nprint(17 * 23)\n</code>"


def test_fenced_code_inside_tags():
    call = parse_code_call("<code>\n```python\nx = 2\nprint(x ** 10)\n```\n</code>")
    assert call is not None and call.error is None
    assert call.code == "x = 2\nprint(x ** 10)"


def test_text_after_close_tag_is_ignored():
    call = parse_code_call("<code>print(1)</code>\n<interp")
    assert call is not None and call.code == "print(1)"


def test_truncated_call_is_malformed():
    call = parse_code_call("Let me see <code>\nfor i in range(10):\n    print(")
    assert call is not None and call.code == ""
    assert "not closed" in call.error


def test_nested_tags_are_malformed():
    call = parse_code_call("<code>print(1)\n<code>print(2)</code>")
    assert call is not None and call.code == ""
    assert "nested" in call.error


def test_stray_close_tag_is_malformed():
    call = parse_code_call("the answer </code>")
    assert call is not None and "without an opening" in call.error


def test_empty_code_is_malformed():
    call = parse_code_call("<code>\n   \n</code>")
    assert call is not None and "empty" in call.error


@pytest.mark.parametrize("text", ["The answer is \\boxed{42}.", "", "no tags at all <cod"])
def test_missing_tags_means_no_call(text):
    assert parse_code_call(text) is None


def test_interpreter_format_and_rendering():
    assert format_interpreter(" 42\n") == "\n<interpreter>\n42\n</interpreter>\n"
    assert "TimeoutError" in render_run_output("", "", "TimeLimitExceeded", max_chars=100)
    err = render_run_output("", "Traceback...\nZeroDivisionError: division by zero", "Error", max_chars=100)
    assert err == "ZeroDivisionError: division by zero"
    long = render_run_output("x" * 500, "", "Finished", max_chars=100)
    assert long.startswith("x" * 100) and "truncated 400" in long
