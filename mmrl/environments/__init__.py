"""Tools for multi-turn rollouts: parse the model's calls, run them, give back observations.

    turn = parse_tool_calls(text)                       # well-formed calls + one error per bad one
    obs = run_tool_batches([(turn.calls, ctx)], ToolLimits())[0]
    ctx.add_observations(obs)                           # the new images join the trajectory
    messages = merge_observations(turn, obs)            # one answer per call written, in order

Tools are registered by name (`register_tool`, `register_verl_tool`); the built-in ones
(`zoom_in`, `rotate`, `image_info`) register when this package is imported; their settings
(`ZOOM_OUTPUT_SIDE`, `ZOOM_MIN_SIDE`) are module constants of `mmrl.environments.builtin`.

Environments (`mmrl.environments.envs`): a trajectory acts in its own env, one model turn per
step; MiniGrid's small tasks register on import (`mmrl.environments.minigrid_env`):

    session = EnvSession(EnvSpec(id="minigrid-empty-5x5"))       # or a Gymnasium id
    first = reset_sessions([session], [seed], limits)[0]           # image + text, the first turn
    step = step_sessions([session], [model_text], limits)[0]       # .observation .reward .error

A TRL-style environment class (`environment_factory`: `reset(**row)`, public methods as tools,
optional `get_reward()`) registers its methods as tools, one instance per trajectory
(`register_environment_class`, `mmrl.environments.trl_env`).
"""

from mmrl.environments import (
    builtin,  # noqa: F401 - registers the built-in tools
    grid_goal,  # noqa: F401 - registers minigrid-goal
)
from mmrl.environments.envs import (
    ENDING_ERRORS,
    ERROR_KINDS,
    EnvEntry,
    EnvSession,
    EnvStep,
    UnknownEnvError,
    action_words,
    default_action,
    default_observation,
    env_known,
    env_names,
    make_env,
    register_env,
    register_gym_family,
    reset_sessions,
    step_sessions,
    tagged_action,
    unregister_env,
)
from mmrl.environments.executor import (
    apply_limits,
    release_all,
    release_batches,
    run_tool_batches,
    run_tool_call,
    run_tool_calls,
)
from mmrl.environments.minigrid_env import (
    ACTION_WORDS,  # importing minigrid_env registers the MiniGrid tasks
    MINIGRID_TASKS,
    expert_actions,
    make_minigrid,
    minigrid_observation,
)
from mmrl.environments.parsers import (
    call_format_names,
    error_observations,
    merge_observations,
    parse_tool_calls,
    register_call_format,
    tool_call_text,
)
from mmrl.environments.tools import (
    FunctionTool,
    Observation,
    ParsedTurn,
    Tool,
    ToolArgumentError,
    ToolCall,
    ToolContext,
    ToolLimits,
    add_tool,
    check_arguments,
    get_tool,
    register_tool,
    tool_names,
    tool_schemas,
    unregister_tool,
)
from mmrl.environments.trl_env import TrlEnvironment, register_environment_class, sample_row
from mmrl.environments.verl_adapter import VerlToolAdapter, register_verl_tool

__all__ = [
    "ACTION_WORDS",
    "ENDING_ERRORS",
    "ERROR_KINDS",
    "EnvEntry",
    "EnvSession",
    "EnvStep",
    "MINIGRID_TASKS",
    "UnknownEnvError",
    "action_words",
    "default_action",
    "default_observation",
    "env_known",
    "env_names",
    "expert_actions",
    "make_env",
    "make_minigrid",
    "minigrid_observation",
    "register_env",
    "register_gym_family",
    "reset_sessions",
    "step_sessions",
    "tagged_action",
    "unregister_env",
    "FunctionTool",
    "Observation",
    "ParsedTurn",
    "Tool",
    "ToolArgumentError",
    "ToolCall",
    "ToolContext",
    "ToolLimits",
    "TrlEnvironment",
    "VerlToolAdapter",
    "add_tool",
    "apply_limits",
    "call_format_names",
    "check_arguments",
    "error_observations",
    "get_tool",
    "merge_observations",
    "parse_tool_calls",
    "register_call_format",
    "register_environment_class",
    "register_tool",
    "register_verl_tool",
    "release_all",
    "release_batches",
    "run_tool_call",
    "run_tool_batches",
    "run_tool_calls",
    "sample_row",
    "tool_call_text",
    "tool_names",
    "tool_schemas",
    "unregister_tool",
]
