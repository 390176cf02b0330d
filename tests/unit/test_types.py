"""grpo_flyte.types: what Flyte does with the values that cross task boundaries."""

from __future__ import annotations

import asyncio

import pytest
from flyte._internal.runtime import convert
from flyte._internal.runtime.types_serde import transform_native_to_typed_interface
from flyte.io import Dir
from flyte.types import TypeEngine
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema

from grpo_flyte import types
from grpo_flyte.config.run import RunConfig
from grpo_flyte.loop.batches import generate_parts
from grpo_flyte.rollout import generate
from grpo_flyte.types import AdapterRef, Example, RolloutGroup, ScoredGroup


@pytest.fixture
def schemas_built(monkeypatch) -> list[str]:
    """The classes pydantic builds a JSON schema for, from now on (with an empty cache)."""
    types._json_schema.cache_clear()
    built = []
    real = GenerateJsonSchema.generate

    def generate_schema(self, schema, mode="validation"):
        built.append(schema.get("cls", schema.get("schema", {}).get("cls", type(None))).__name__)
        return real(self, schema, mode)

    monkeypatch.setattr(GenerateJsonSchema, "generate", generate_schema)
    return built


def test_flyte_builds_each_task_value_schema_once_not_on_every_task_call(schemas_built):
    """Flyte local mode asks the JSON schema of every input type on every task call (the task's
    interface and each input's literal type); pydantic built them anew each time, 8 of the 12 ms
    of a `generate` call's input conversion."""
    config = RunConfig()
    inputs = dict(
        **generate_parts(config),
        base_model=Dir(path="/models/base"),
        adapter=AdapterRef(version=0, dir=Dir(path="/adapters/v0000")),
        example=Example(question="What is 1 + 2?", answer="3"),
        index=0,
        seed=1,
    )

    def one_call() -> None:  # what the local controller converts per generate call
        transform_native_to_typed_interface(generate.interface)
        asyncio.run(convert.convert_from_native_to_inputs(generate.native_interface, **inputs))

    one_call()
    first = list(schemas_built)
    assert {"ModelConfig", "EngineConfig", "PromptConfig", "SamplingConfig", "AdapterRef", "Example", "RolloutGroup"} <= set(first)
    for _ in range(3):
        one_call()
    assert schemas_built == first


@pytest.mark.parametrize("model", [RunConfig, RolloutGroup, ScoredGroup])
def test_a_kept_schema_is_pydantics_own_and_each_caller_gets_its_own_copy(model):
    from flyte.types._type_engine import CustomPydanticJsonSchemaGenerator

    fresh = BaseModel.model_json_schema.__func__(model, schema_generator=CustomPydanticJsonSchemaGenerator)
    mine = model.model_json_schema(schema_generator=CustomPydanticJsonSchemaGenerator)
    assert mine == fresh
    mine["properties"].clear()
    assert model.model_json_schema(schema_generator=CustomPydanticJsonSchemaGenerator) == fresh
    assert model.model_json_schema() == BaseModel.model_json_schema.__func__(model)  # other arguments, another schema
    assert TypeEngine.to_literal_type(model) == TypeEngine.to_literal_type(model)
