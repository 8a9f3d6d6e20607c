"""The marker strings of DeepSeek's chat formats (facts of the released tokenizers and encoders).

Turn markers and the V3/V3.1 tool markers are single tokens in DeepSeek's vocabularies (and in
ours, see `dsv4_engine.checkpoint`); `<think>`/`</think>` too. The DSML prefix of V3.2/V4 tool
calls is text in the release vocabulary; our tiny checkpoints make `｜DSML｜` one token.
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"

# DeepSeek-V3 / V3.1 tool calls and tool outputs
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"

# DeepSeek-V3.2 / V4 "DSML" tool calls: <｜DSML｜{block}> ... </｜DSML｜{block}>, where the block is
# `function_calls` in V3.2 and `tool_calls` in V4.
DSML = "｜DSML｜"
# The full-width bar every DeepSeek marker above holds: tool-call argument text never needs it
# raw, so the tool-call grammar keeps it (and with it any marker token) out of argument strings.
MARKER_BAR = "｜"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# Tokens `dsv4 model init` adds (not "special": a decode that skips special tokens keeps them, so
# parsers see them in the text, as with DeepSeek's own tokenizers).
CHAT_ADDED_TOKENS = (
    THINK_START,
    THINK_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_SEP,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    DSML,
)
