import json
import re

import pytest
from datasets import Dataset

from hpcrl.data.files import DataError, Shape, decode_columns, load_rows, peek


@pytest.fixture
def write(tmp_path):
    def write(name: str, rows: list | None = None, text: str | None = None) -> str:
        path = tmp_path / name
        if name.endswith(".parquet"):
            Dataset.from_list(rows).to_parquet(str(path))
        elif name.endswith(".json") and text is None:
            path.write_text(json.dumps(rows))
        else:
            path.write_text(text if text is not None else "".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    return write


@pytest.fixture
def load(tmp_path):
    def load(files, **kwargs):
        return load_rows(files, cache_dir=str(tmp_path / "cache"), **kwargs).to_list()

    return load


def test_jsonl_rows_with_a_template_using_other_columns(write, load):
    path = write(
        "a.jsonl",
        [{"question": "1+1?", "answer": "2", "topic": "sums"}, {"question": "2+2?", "answer": "4", "topic": "more"}],
    )
    rows = load([path], prompt_column="question", prompt_template="[{topic}] Q: {prompt}\nA:")
    assert rows == [{"prompt": "[sums] Q: 1+1?\nA:", "answer": "2"}, {"prompt": "[more] Q: 2+2?\nA:", "answer": "4"}]


def test_parquet_rows(write, load):
    path = write("a.parquet", [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}])
    assert load([path]) == [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}]


def test_a_json_array_file(write, load):
    assert load([write("a.json", [{"prompt": "x", "answer": "1"}])]) == [{"prompt": "x", "answer": "1"}]


def test_files_are_concatenated_in_order_even_with_different_answer_types(write, load):
    first = write("a.jsonl", [{"prompt": "x", "answer": "1"}])
    second = write("b.jsonl", [{"prompt": "y", "answer": 2}, {"prompt": "z", "answer": 2.5}])
    third = write("c.jsonl", [{"prompt": "w", "answer": 3.0}])
    assert [r["answer"] for r in load([first, second, third])] == ["1", "2", "2.5", "3"]


def test_numbers_become_strings_in_parquet_too(write, load):
    assert [r["answer"] for r in load([write("a.parquet", [{"prompt": "x", "answer": 7}])])] == ["7"]


def test_strings_in_a_column_of_mixed_types_are_kept_as_written(write, load):
    # datasets reads back strings of such a column as the JSON they spell ("01" -> 1, "[1, 2]" -> a list)
    path = write(
        "a.jsonl", [{"prompt": "x", "answer": "01"}, {"prompt": "y", "answer": "[1, 2]"}, {"prompt": "z", "answer": 3}]
    )
    assert [r["answer"] for r in load([path])] == ["01", "[1, 2]", "3"]


def test_a_missing_file(tmp_path, load):
    with pytest.raises(DataError, match=r"nope\.jsonl: does not exist"):
        load([str(tmp_path / "nope.jsonl")])


def test_an_unknown_extension(write, load):
    with pytest.raises(
        DataError, match=r"a\.csv: unknown extension '\.csv'; expected one of \.jsonl, \.json, \.parquet"
    ):
        load([write("a.csv", text="prompt,answer\n")])


def test_mixing_json_and_parquet(write, load):
    rows = [{"prompt": "x", "answer": "1"}]
    with pytest.raises(DataError, match="mix json and parquet"):
        load([write("a.jsonl", rows), write("b.parquet", rows)])


def test_a_missing_column_names_the_file_and_lists_the_columns(write, load):
    path = write("a.jsonl", [{"prompt": "x", "solution": "1"}])
    with pytest.raises(DataError) as e:
        load([path])
    expected = "row 0: no column 'answer' (named by dataset.answer_column); the file's columns are: prompt, solution"
    assert str(e.value) == f"{path}: {expected}"


def test_a_list_answer_names_the_file_row_and_line(write, load):
    text = '{"prompt": "x", "answer": "1"}\n\n{"prompt": "y", "answer": "2"}\n{"prompt": "z", "answer": [1, 2]}\n'
    path = write("a.jsonl", text=text)
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(path)}: row 2 \(line 4\): column 'answer' is a list \(\[1, 2\]\); expected a string",
    ):
        load([path])


def test_a_list_answer_among_strings(write, load):
    path = write("a.jsonl", [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": [1]}])
    with pytest.raises(DataError, match=rf"^{re.escape(path)}: row 1 \(line 2\): column 'answer' is a list"):
        load([path])


def test_a_list_answer_in_parquet(write, load):
    path = write("a.parquet", [{"prompt": "x", "answer": ["1"]}])
    with pytest.raises(DataError, match=rf"^{re.escape(path)}: row 0: column 'answer' is a list \(\['1'\]\)"):
        load([path])


@pytest.mark.parametrize("row", [{"prompt": "y"}, {"prompt": "y", "answer": None}])
def test_a_missing_or_null_answer(write, load, row):
    path = write("a.jsonl", [{"prompt": "x", "answer": "1"}, row])
    with pytest.raises(DataError, match=rf"^{re.escape(path)}: row 1 \(line 2\): column 'answer' is missing or null"):
        load([path])


def test_a_null_answer_in_parquet(write, load):
    path = write(
        "a.parquet", [{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}, {"prompt": "z", "answer": None}]
    )
    with pytest.raises(DataError, match=rf"^{re.escape(path)}: row 2: column 'answer' is missing or null"):
        load([path])


def test_a_boolean_answer(write, load):
    path = write("a.jsonl", [{"prompt": "x", "answer": True}])
    with pytest.raises(DataError, match=r"row 0 \(line 1\): column 'answer' is a bool \(True\)"):
        load([path])


def test_a_prompt_that_is_not_a_string(write, load):
    path = write("a.parquet", [{"q": 5, "answer": "1"}])
    with pytest.raises(
        DataError, match=rf"^{re.escape(path)}: row 0: column 'q' is a int \(5\); expected a string prompt"
    ):
        load([path], prompt_column="q")


def test_a_template_naming_an_unknown_column(write, load):
    path = write("a.jsonl", [{"prompt": "x", "answer": "1"}])
    with pytest.raises(
        DataError, match=rf"^{re.escape(path)}: row 0: no column 'topic' \(named by dataset\.prompt_template\)"
    ):
        load([path], prompt_template="{topic}: {prompt}")


def test_a_template_failing_on_one_row(write, load):
    path = write(
        "a.jsonl", [{"prompt": "x", "answer": "1", "meta": {"k": 1}}, {"prompt": "y", "answer": "2", "meta": {"j": 1}}]
    )
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(path)}: row 1 \(line 2\): dataset.prompt_template=.* fails on this row: KeyError",
    ):
        load([path], prompt_template="{meta[k]} {prompt}")


@pytest.mark.parametrize("template", ["{} {prompt}", "{prompt", "{0}"])
def test_a_malformed_template(write, load, template):
    with pytest.raises(DataError, match="prompt_template"):
        load([write("a.jsonl", [{"prompt": "x", "answer": "1"}])], prompt_template=template)


def test_invalid_json_names_the_file_row_and_line(write, load):
    path = write("a.jsonl", text='{"prompt": "x", "answer": "1"}\n{"prompt": "y", "answer": \n')
    with pytest.raises(DataError, match=rf"^{re.escape(path)}: row 1 \(line 2\): not valid JSON"):
        load([path])


def test_a_line_that_is_not_an_object(write, load):
    path = write("a.jsonl", text='{"prompt": "x", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(DataError, match=rf"^{re.escape(path)}: row 1 \(line 2\): expected a JSON object"):
        load([path])


def test_an_empty_file(write, load):
    with pytest.raises(DataError, match=r"a\.jsonl: the file is empty"):
        load([write("a.jsonl", text="")])


def test_no_files(load):
    with pytest.raises(DataError, match="expected a non-empty list"):
        load([])


def test_the_columns_the_rewards_take_go_with_each_row_as_the_file_holds_them(write, load):
    rows = [{"q": "a", "answer": "1", "low": 1, "tags": ["x", "y"], "meta": {"k": None}, "unused": "u"}]
    path = write("r.jsonl", rows)
    loaded = load([path], prompt_column="q", takes=("low", "tags", "meta", "absent"), needs={"low": "the reward"})
    assert [decode_columns(r) for r in loaded] == [
        {"prompt": "a", "answer": "1", "columns": {"low": 1, "tags": ["x", "y"], "meta": {"k": None}}}
    ]
    everything = load([path], prompt_column="q", takes=None)  # a reward with **kwargs: every column
    assert decode_columns(everything[0])["columns"] == rows[0]
    assert "columns" not in load([path], prompt_column="q"), "no column is carried for rewards that take none"


def test_a_column_a_reward_needs_is_checked_as_the_prompts_is(write, load):
    path = write("r.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DataError) as e:
        load([path], needs={"low": "the parameter 'low' of reward function 'm:f'"})
    assert str(e.value) == (
        f"{path}: row 0: no column 'low' (named by the parameter 'low' of reward function 'm:f'); the file's columns "
        "are: prompt, answer"
    )


def test_a_column_value_that_is_not_json_is_named(write, load):
    path = write("r.parquet", [{"prompt": "a", "answer": "1", "blob": b"\x00\x01"}])
    with pytest.raises(DataError, match=r"r\.parquet: row 0: column 'blob' is a bytes .*takes as a JSON value"):
        load([path], takes=("blob",))


@pytest.mark.parametrize("name", ["a.jsonl", "a.json", "a.parquet", "lines.json"])
def test_peek_reads_the_columns_and_the_row_count_as_loading_would(write, load, name):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(7)]
    if name == "lines.json":  # JSON lines in a .json file, with blank lines between
        path = write(name, text="\n\n".join(json.dumps(r) for r in rows) + "\n\n")
    else:
        path = write(name, rows)
    assert (
        peek(path)
        == Shape(["question", "answer"], 7)
        == Shape(["question", "answer"], len(load([path], prompt_column="question")))
    )
    assert peek(path, count=False).columns == ["question", "answer"]


def test_peek_refuses_what_loading_refuses(write):
    with pytest.raises(DataError, match="the file is empty"):
        peek(write("empty.jsonl", text=""))
    with pytest.raises(DataError, match="does not exist"):
        peek(str(write("x.jsonl", text="{}\n")).replace("x.jsonl", "y.jsonl"))
