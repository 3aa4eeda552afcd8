"""encode_messages against CHAT_FORMAT.md: the §7 worked examples byte for byte, §3 cases, §2 rules."""

import pytest

from deepseek_v41.chat import encode_messages

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "days": {"type": "integer", "description": "Forecast days"},
                "options": {"type": "object", "description": "Extra options"},
            },
            "required": ["city"],
        },
    },
}

# §7, rendered prompts as the document prints them (Python string literals).
EXAMPLE_1 = "<｜begin▁of▁sentence｜><｜System｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜></think>"  # noqa: E501
EXAMPLE_2 = "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n<｜User｜>Hi<｜Assistant｜></think>Hello! How can I help?<｜end▁of▁sentence｜><｜User｜>Name a prime number.<｜Assistant｜><think>"  # noqa: E501
EXAMPLE_3 = '<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more thorough the reasoning)\n\nYou are a weather bot.\n\n## Tools\n\nYou have access to a set of tools to help answer the user\'s question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="$TOOL_NAME">\n<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name="$TOOL_NAME2">\n...\n</｜DSML｜ invoke>\n</｜DSML｜ calls>\n\nString parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n{"name": "get_weather", "description": "Get the current weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}, "days": {"type": "integer", "description": "Forecast days"}, "options": {"type": "object", "description": "Extra options"}}, "required": ["city"]}}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n<｜User｜>Weather in Paris and Tokyo?<｜Assistant｜><think>Call the tool twice.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Tokyo</｜DSML｜ parameter>\n<｜DSML｜ parameter name="options" string="false">{"unit": "C", "alerts": true}</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>Paris: 11C</tool_result>\n\n<tool_result>Tokyo: 18C</tool_result><｜Assistant｜><think>'  # noqa: E501

EFFORT_75 = "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def weather_conversation(arguments_as_dicts: bool = False) -> list[dict]:
    """The request of §7 example 3, arguments as the JSON strings it sends (or as the same dicts)."""
    paris, tokyo = (
        '{"city": "Paris", "days": 2}',
        '{"city": "Tokyo", "options": {"unit": "C", "alerts": true}}',
    )
    if arguments_as_dicts:
        paris = {"city": "Paris", "days": 2}
        tokyo = {"city": "Tokyo", "options": {"unit": "C", "alerts": True}}
    return [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "reasoning_content": "Call the tool twice.",
            "content": "",
            "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": paris}},
                {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": tokyo}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_b", "content": "Tokyo: 18C"},
        {"role": "tool", "tool_call_id": "call_a", "content": "Paris: 11C"},
    ]


# --- §7 worked examples -------------------------------------------------------------------------------


def test_example_1_chat_system_user():
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert (
        encode_messages(messages, tools=None, thinking=False, reasoning_effort=None, drop_thinking=True)
        == EXAMPLE_1
    )


def test_example_2_thinking_multiturn_history_reasoning_dropped():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a prime number."},
    ]
    assert encode_messages(messages, thinking=True, reasoning_effort=None, drop_thinking=True) == EXAMPLE_2


@pytest.mark.parametrize("arguments_as_dicts", [False, True])
def test_example_3_thinking_tools_parallel_calls_and_results(arguments_as_dicts):
    prompt = encode_messages(
        weather_conversation(arguments_as_dicts), tools=[WEATHER_TOOL], thinking=True, reasoning_effort="max"
    )
    assert prompt == EXAMPLE_3


def test_encoding_does_not_mutate_the_request():
    messages, tools = weather_conversation(), [WEATHER_TOOL]
    before = repr((messages, tools))
    encode_messages(messages, tools=tools, thinking=True)
    assert repr((messages, tools)) == before


# --- §3(a), §3(b): the basic cases ----------------------------------------------------------------------


def test_thinking_system_user_default_effort():
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert encode_messages(messages, thinking=True) == (
        "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75 + "You are a helpful assistant."
        "<｜User｜>What is 2+2?<｜Assistant｜><think>"
    )


def test_no_system_chat():
    assert encode_messages([{"role": "user", "content": "q"}]) == (
        "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think>"
    )


def test_chat_multiturn_never_renders_reasoning():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert encode_messages(messages, drop_thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>"
        "<｜User｜>Bye<｜Assistant｜></think>"
    )


def test_thinking_without_drop_keeps_every_reasoning():
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "Greet back.", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert encode_messages(messages, thinking=True, drop_thinking=False) == (
        "<｜begin▁of▁sentence｜><｜System｜>"
        + EFFORT_75
        + "<｜User｜>Hi<｜Assistant｜><think>Greet back.</think>"
        "Hello!<｜end▁of▁sentence｜><｜User｜>Bye<｜Assistant｜><think>"
    )


def test_tools_force_drop_thinking_off():
    # §2 rule 4: with tools every earlier assistant keeps <think>{reasoning}</think>, empty when omitted.
    tool = {"type": "function", "function": {"name": "f"}}
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "reasoning_content": "r1", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
        {"role": "user", "content": "e"},
    ]
    prompt = encode_messages(messages, tools=[tool], thinking=True, drop_thinking=True)
    assert prompt.endswith(
        "<｜User｜>a<｜Assistant｜><think>r1</think>b<｜end▁of▁sentence｜>"
        "<｜User｜>c<｜Assistant｜><think></think>d<｜end▁of▁sentence｜><｜User｜>e<｜Assistant｜><think>"
    )


def test_assistant_after_last_user_keeps_reasoning_with_drop_on():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "reasoning_content": "r", "content": "a"},
    ]
    assert encode_messages(messages, thinking=True).endswith(
        "<｜User｜>q<｜Assistant｜><think>r</think>a<｜end▁of▁sentence｜>"
    )


# --- §2 per-message rules -------------------------------------------------------------------------------


def test_thinking_prompt_without_system_starts_with_system_token():
    assert encode_messages([{"role": "user", "content": "q"}], thinking=True) == (
        "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75 + "<｜User｜>q<｜Assistant｜><think>"
    )


def test_effort_line_only_once_and_only_in_thinking():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    assert encode_messages(messages, thinking=True, reasoning_effort=30).count("Reasoning Effort: 30 ") == 1
    assert "Reasoning Effort" not in encode_messages(messages, thinking=False, reasoning_effort="max")


@pytest.mark.parametrize(
    ("effort", "budget"), [(None, 75), ("low", 50), ("high", 75), ("max", 100), (1, 1), (100, 100)]
)
def test_effort_table(effort, budget):
    prompt = encode_messages([{"role": "user", "content": "q"}], thinking=True, reasoning_effort=effort)
    assert prompt.startswith(f"<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: {budget} (range 1-100,")


def test_empty_system_with_tools_gives_four_newlines_after_effort():
    tool = {"type": "function", "function": {"name": "f"}}
    prompt = encode_messages(
        [{"role": "system", "content": ""}, {"role": "user", "content": "q"}], tools=[tool], thinking=True
    )
    assert prompt.startswith("<｜begin▁of▁sentence｜><｜System｜>" + EFFORT_75[:-2] + "\n\n\n\n## Tools\n\n")


def test_response_format_follows_the_system_content():
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    prompt = encode_messages(
        [{"role": "system", "content": "S", "response_format": schema}, {"role": "user", "content": "q"}]
    )
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>S\n\n## Response Format:\n\n"
        "You MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}'
        "<｜User｜>q<｜Assistant｜></think>"
    )


def test_tool_result_with_list_content_joins_its_text_parts():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "1",
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        },
    ]
    assert encode_messages(messages).endswith(
        "<｜User｜><tool_result>a\n\nb</tool_result><｜Assistant｜></think>"
    )


def test_wo_eos_leaves_the_last_assistant_open():
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "The answer is", "wo_eos": True},
    ]
    assert encode_messages(messages) == (
        "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think>The answer is"
    )


def test_latest_reminder_follows_the_header():
    messages = [{"role": "user", "content": "q"}, {"role": "latest_reminder", "content": "today is Monday"}]
    assert encode_messages(messages) == (
        "<｜begin▁of▁sentence｜><｜User｜>q<｜Assistant｜></think><｜latest_reminder｜>today is Monday"
    )


def test_mid_conversation_system_renders_and_takes_the_header():
    # §3(f) / golden 5: a trailing mid-conversation system message gets the Assistant header.
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": "Be brief."},
    ]
    assert encode_messages(messages, thinking=True).endswith(
        "<｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜><｜System｜>Be brief.<｜Assistant｜><think>"
    )


def test_system_at_index_0_gets_no_header():
    assert encode_messages([{"role": "system", "content": "S"}]) == "<｜begin▁of▁sentence｜><｜System｜>S"


def test_header_only_before_assistant_reminder_or_end():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "system", "content": "S"},
        {"role": "user", "content": "b"},
    ]
    assert encode_messages(messages) == (
        "<｜begin▁of▁sentence｜><｜User｜>a<｜System｜>S<｜User｜>b<｜Assistant｜></think>"
    )


# --- quick-instruction tasks (§2, "Tasks") ----------------------------------------------------------------


def test_action_task_official_test_4():
    messages = [
        {"role": "user", "content": "世界著名温泉有哪些", "task": "action"},
        {"role": "assistant", "content": "Search"},
    ]
    assert encode_messages(messages) == (
        "<｜begin▁of▁sentence｜><｜User｜>世界著名温泉有哪些<｜Assistant｜></think><｜action｜>Search<｜end▁of▁sentence｜>"
    )


def test_action_task_in_thinking_mode_opens_think_and_skips_the_thinking_part():
    messages = [
        {"role": "user", "content": "q", "task": "action"},
        {"role": "assistant", "content": "Search"},
    ]
    assert encode_messages(messages, thinking=True).endswith(
        "<｜User｜>q<｜Assistant｜><think><｜action｜>Search<｜end▁of▁sentence｜>"
    )


def test_other_tasks_append_their_token_without_a_header():
    assert encode_messages([{"role": "user", "content": "q", "task": "query"}]) == (
        "<｜begin▁of▁sentence｜><｜User｜>q<｜query｜>"
    )


# --- §3(h) images ------------------------------------------------------------------------------------------


def test_images_golden_6():
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    content = [{"type": "text", "text": "Compare"}, image, {"type": "text", "text": "with"}, image]
    assert encode_messages([{"role": "user", "content": content}]) == (
        "<｜begin▁of▁sentence｜><｜User｜>Compare\n\n<｜deepseek_image｜>\n\nwith\n\n<｜deepseek_image｜>"
        "<｜Assistant｜></think>"
    )


def test_empty_text_parts_are_kept():
    content = [{"type": "text", "text": ""}, {"type": "image", "url": "file:///a.png"}]
    assert encode_messages([{"role": "user", "content": content}]) == (
        "<｜begin▁of▁sentence｜><｜User｜>\n\n<｜deepseek_image｜><｜Assistant｜></think>"
    )


def test_images_in_tool_results_become_placeholders():
    messages = [
        {"role": "user", "content": "look"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "shot", "arguments": {}}}],
        },
        {
            "role": "tool",
            "tool_call_id": "1",
            "content": [{"type": "image_url", "image_url": "data:image/png;base64,AA"}],
        },
    ]
    assert encode_messages(messages).endswith(
        "<｜User｜><tool_result><｜deepseek_image｜></tool_result><｜Assistant｜></think>"
    )


# --- the developer role: a user turn with its own tools / response format; dropped like an assistant ----------
# Expected strings follow the reference's rules for a developer message: "<｜User｜>" + its text, then "\n\n" + the
# tools block and "\n\n" + the response-format block when it carries them; it counts as a user turn for the
# generation header; in thinking mode with drop on, one before the last user turn is left out.
TOOLS_BLOCK = EXAMPLE_3[EXAMPLE_3.index("## Tools"):EXAMPLE_3.index("<｜User｜>")]  # §7 example 3, ends with "\n"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def test_developer_renders_as_its_own_user_turn():
    messages = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"}]
    assert encode_messages(messages) == f"{BOS}<｜User｜>Answer in French.<｜User｜>Hi<｜Assistant｜></think>"
    tool_after = [{"role": "developer", "content": "d"}, {"role": "tool", "tool_call_id": "x", "content": "r"}]
    expected = f"{BOS}<｜User｜>d<｜User｜><tool_result>r</tool_result><｜Assistant｜></think>"
    assert encode_messages(tool_after) == expected  # a tool result never joins a developer turn


def test_developer_carrying_tools():
    messages = [{"role": "developer", "content": "Use the tools.", "tools": [WEATHER_TOOL]},
                {"role": "user", "content": "Weather in Paris?"}]
    body = f"<｜User｜>Use the tools.\n\n{TOOLS_BLOCK}<｜User｜>Weather in Paris?<｜Assistant｜>"
    assert encode_messages(messages) == f"{BOS}{body}</think>"
    # Thinking: the effort line opens the prompt; tools turn the drop off, so the developer turn is kept.
    assert encode_messages(messages, thinking=True) == f"{BOS}<｜System｜>{EFFORT_75}{body}<think>"


def test_request_tools_with_a_developer_message_go_to_an_inserted_system_turn():
    messages = [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}]
    expected = f"{BOS}<｜System｜>\n\n{TOOLS_BLOCK}<｜User｜>d<｜User｜>q<｜Assistant｜></think>"
    assert encode_messages(messages, tools=[WEATHER_TOOL]) == expected


def test_developer_response_format():
    messages = [{"role": "developer", "content": "Reply in JSON.", "response_format": {"type": "object"}},
                {"role": "user", "content": "Hi"}]
    assert encode_messages(messages) == (
        f"{BOS}<｜User｜>Reply in JSON.\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to "
        'reply:\n{"type": "object"}<｜User｜>Hi<｜Assistant｜></think>')


def test_developer_before_the_last_user_is_dropped_in_thinking_mode():
    messages = [{"role": "system", "content": "S"}, {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Hi"}]
    head = f"{BOS}<｜System｜>{EFFORT_75}S"
    assert encode_messages(messages, thinking=True) == f"{head}<｜User｜>Hi<｜Assistant｜><think>"
    assert encode_messages(messages, thinking=True, drop_thinking=False) == (
        f"{head}<｜User｜>Be brief.<｜User｜>Hi<｜Assistant｜><think>")
    assert encode_messages(messages) == f"{BOS}<｜System｜>S<｜User｜>Be brief.<｜User｜>Hi<｜Assistant｜></think>"
    # A developer message first, then the user: after the drop the user turn is index 0 and carries the effort.
    assert encode_messages(messages[1:], thinking=True) == (
        f"{BOS}<｜System｜>{EFFORT_75}<｜User｜>Hi<｜Assistant｜><think>")


def test_a_trailing_developer_message_is_the_live_turn():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "r"},
                {"role": "developer", "content": "Now in French."}]
    assert encode_messages(messages, thinking=True) == (
        f"{BOS}<｜System｜>{EFFORT_75}<｜User｜>Hi<｜Assistant｜></think>Hello{EOS}<｜User｜>Now in French."
        f"<｜Assistant｜><think>")
