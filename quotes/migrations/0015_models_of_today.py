"""The personas' models as Cloudflare runs them today: every persona on a retired Workers AI model
moves to its successor (and its fallbacks with it), as a new version whose note says why, so the
admin's history shows the move. Rows keep the model that wrote them."""

from django.db import migrations, models

# Retired model -> (its successor, the day Cloudflare retired it), as quotes/backends/
# workers_ai_models.json said when this was written (not imported: the snapshot moves on; a later
# refresh that retires more models comes with a migration of its own).
MOVES = {
    "@cf/deepseek-ai/deepseek-math-7b-instruct": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/defog/sqlcoder-7b-2": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@cf/facebook/bart-large-cnn": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@cf/fblgit/una-cybertron-7b-v2-bf16": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/google/gemma-3-12b-it": ("@cf/aisingapore/gemma-sea-lion-v4-27b-it", "2026-05-30"),
    "@cf/meta/llama-2-7b-chat-fp16": ("@cf/meta/llama-3.2-3b-instruct", "2026-05-30"),
    "@cf/meta/llama-2-7b-chat-int8": ("@cf/meta/llama-3.2-3b-instruct", "2026-05-30"),
    "@cf/meta/llama-3-8b-instruct": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@cf/meta/llama-3-8b-instruct-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@cf/meta/llama-3.1-70b-instruct": ("@cf/meta/llama-3.3-70b-instruct-fp8-fast", "2026-05-30"),
    "@cf/meta/llama-3.1-8b-instruct": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@cf/meta/llama-3.1-8b-instruct-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@cf/microsoft/phi-2": ("@cf/meta/llama-3.2-3b-instruct", "2026-05-30"),
    "@cf/mistral/mistral-7b-instruct-v0.1": ("@cf/mistralai/mistral-small-3.1-24b-instruct", "2026-05-30"),
    "@cf/moonshotai/kimi-k2.5": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@cf/openchat/openchat-3.5-0106": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/qwen/qwen1.5-0.5b-chat": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/qwen/qwen1.5-1.8b-chat": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/qwen/qwen1.5-14b-chat-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/qwen/qwen1.5-7b-chat-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/thebloke/discolm-german-7b-v1-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/tiiuae/falcon-7b-instruct": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/tinyllama/tinyllama-1.1b-chat-v1.0": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@cf/unum/uform-gen2-qwen-500m": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@hf/google/gemma-7b-it": ("@cf/aisingapore/gemma-sea-lion-v4-27b-it", "2026-05-30"),
    "@hf/meta-llama/meta-llama-3-8b-instruct": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@hf/mistral/mistral-7b-instruct-v0.2": ("@cf/mistralai/mistral-small-3.1-24b-instruct", "2026-05-30"),
    "@hf/nexusflow/starling-lm-7b-beta": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@hf/nousresearch/hermes-2-pro-mistral-7b": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2026-05-30"),
    "@hf/thebloke/deepseek-coder-6.7b-base-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@hf/thebloke/deepseek-coder-6.7b-instruct-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@hf/thebloke/llama-2-13b-chat-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@hf/thebloke/llamaguard-7b-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@hf/thebloke/mistral-7b-instruct-v0.1-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@hf/thebloke/neural-chat-7b-v3-1-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@hf/thebloke/openhermes-2.5-mistral-7b-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
    "@hf/thebloke/zephyr-7b-beta-awq": ("@cf/meta/llama-3.1-8b-instruct-fp8", "2025-10-01"),
}

# The fields a version records, as they were when this migration was written.
GENERATION_FIELDS = (
    "system_prompt",
    "user_prompt_template",
    "default_topic",
    "voice_examples",
    "backend",
    "model",
    "fallback_models",
    "lora",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)


def move_off_retired_models(apps, schema_editor):
    Persona = apps.get_model("quotes", "Persona")
    PersonaVersion = apps.get_model("quotes", "PersonaVersion")
    for persona in Persona.objects.order_by("pk"):
        fallbacks = persona.fallback_models if isinstance(persona.fallback_models, list) else []
        moved = sorted({m for m in (persona.model, *fallbacks) if m in MOVES})
        if not moved:
            continue
        model = MOVES.get(persona.model, (persona.model, ""))[0]
        new_fallbacks = []
        for fallback in fallbacks:
            fallback = MOVES.get(fallback, (fallback, ""))[0]
            if fallback != model and fallback not in new_fallbacks:
                new_fallbacks.append(fallback)
        persona.model, persona.fallback_models = model, new_fallbacks
        persona.save(update_fields=["model", "fallback_models"])
        said = "; ".join(f"{m} → {MOVES[m][0]}" for m in moved)
        days = sorted({MOVES[m][1] for m in moved})
        note = f"Cloudflare retired {said} (on {', '.join(days)})"
        last = PersonaVersion.objects.filter(persona=persona).order_by("-number").first()
        PersonaVersion.objects.create(
            persona=persona,
            number=(last.number if last else 0) + 1,
            config={field: getattr(persona, field) for field in GENERATION_FIELDS},
            note=note[:200],
        )


class Migration(migrations.Migration):
    dependencies = [("quotes", "0014_running_rows_refusals_spend")]

    operations = [
        migrations.AddField(
            model_name="generation",
            name="cost_estimated",
            field=models.BooleanField(
                default=False,
                help_text="The upstream sent no token counts (a stop, a dropped or cut-off stream): the cost "
                "is the prompt, counted as the spend ceiling reserves it, plus the text streamed.",
                verbose_name="cost without usage",
            ),
        ),
        migrations.AlterField(
            model_name="persona",
            name="model",
            field=models.CharField(
                default="@cf/meta/llama-3.1-8b-instruct-fp8",
                help_text="A model from the catalog. The embedded model stands in for it when no Cloudflare "
                "credentials are set.",
                max_length=200,
            ),
        ),
        migrations.RunPython(move_off_retired_models, migrations.RunPython.noop),
    ]
