"""Every write of personas, their versions and experiments, the votes on a quote and its being shared: one
transaction each; and the rows a dead process left `running`, marked lost. Reads live in
quotes.admin.analytics.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Field, Max, Sum
from django.utils import timezone

from .backends.base import GENERATION_FIELDS
from .errors import ErrorCode
from .models import Experiment, Generation, Persona, PersonaVersion, Vote


def persona_has_generations(persona: Persona) -> bool:
    """Whether the request log refers to `persona` (then it is deactivated, never deleted)."""
    return persona.pk is not None and persona.generations.exists()


@transaction.atomic
def persona_save(*, persona: Persona, created_by: Any = None, note: str = "") -> PersonaVersion | None:
    """Save `persona`, and return a new version when what it sends to the model changed (else None)."""
    persona.save()
    config = persona.generation_config()
    latest = persona.versions.filter(is_draft=False).order_by("-number").first()
    if latest is not None and latest.config == config:
        return None
    return _new_version(persona, config, created_by=created_by, note=note)


def _new_version(
    persona: Persona, config: dict[str, Any], *, created_by: Any, note: str, draft: bool = False
) -> PersonaVersion:
    number = persona.versions.aggregate(most=Max("number"))["most"] or 0
    return PersonaVersion.objects.create(
        persona=persona,
        number=number + 1,
        config=config,
        note=note[:200],
        created_by=created_by,
        is_draft=draft,
    )


@transaction.atomic
def persona_save_draft(*, persona: Persona, created_by: Any = None, note: str = "") -> PersonaVersion:
    """`persona`'s values (checked, not saved) as a draft version: the persona stays as it is, and
    an experiment can try the draft on a share of its readers."""
    Persona.objects.select_for_update().filter(pk=persona.pk).values_list("pk", flat=True).get()
    return _new_version(
        persona, persona.generation_config(), created_by=created_by, note=note or "draft", draft=True
    )


@transaction.atomic
def experiment_start(*, persona: Persona, draft: PersonaVersion, share: int, user: Any) -> Experiment:
    """Try `draft` on `share` percent of `persona`'s readers; ValidationError when it cannot be:
    not one of its drafts, a share outside 1-99, or an experiment already running."""
    if draft.persona_id != persona.pk or not draft.is_draft:
        raise ValidationError("Only a draft version of this persona can be tried.")
    Persona.objects.select_for_update().filter(pk=persona.pk).values_list("pk", flat=True).get()
    if persona.experiments.filter(ended_at__isnull=True).exists():
        raise ValidationError("An experiment is already running for this persona: end it first.")
    experiment = Experiment(persona=persona, draft=draft, share=share, started_by=user)
    experiment.full_clean()
    experiment.save()
    return experiment


@transaction.atomic
def experiment_finish(*, experiment: Experiment, promote: bool, user: Any) -> PersonaVersion | None:
    """End `experiment`; with `promote`, its draft becomes the persona's live version (a new
    version, returned). ValidationError when the draft is no longer valid (a model left the catalog)."""
    experiment = (
        Experiment.objects.select_for_update().select_related("persona", "draft").get(pk=experiment.pk)
    )
    if experiment.ended_at is not None:
        raise ValidationError("That experiment has ended already.")
    new = None
    if promote:
        draft = experiment.draft
        new = persona_rollback(
            persona=experiment.persona, version=draft, user=user, note=f"promoted draft v{draft.number}"
        )
    experiment.ended_at = timezone.now()
    experiment.outcome = Experiment.Outcome.PROMOTED if promote else Experiment.Outcome.ENDED
    experiment.save(update_fields=["ended_at", "outcome"])
    return new


@transaction.atomic
def persona_rollback(
    *, persona: Persona, version: PersonaVersion, user: Any, note: str = ""
) -> PersonaVersion | None:
    """Apply `version`'s configuration to `persona` as a new version (None: it has it already). A
    field the version does not record goes back to its default; ValidationError when the old
    configuration is no longer valid (a model left the catalog)."""
    if version.persona_id != persona.pk:
        raise ValueError("That version belongs to another persona.")
    for name in GENERATION_FIELDS:
        field = Persona._meta.get_field(name)
        assert isinstance(field, Field)  # a generation field is a concrete column
        setattr(persona, name, version.config.get(name, field.get_default()))
    persona.full_clean()
    return persona_save(persona=persona, created_by=user, note=note or f"rollback to v{version.number}")


@transaction.atomic
def persona_delete(*, persona: Persona) -> bool:
    """Delete `persona`, or deactivate it (True) when the request log refers to it."""
    if persona_has_generations(persona):
        persona.is_active = False
        persona.save(update_fields=["is_active"])
        return True
    persona.delete()
    return False


def _generation_feedback_set(*, generation_id: int, client_key: str, value: int) -> None:
    """Set this client's vote (1 or -1), then the quote's verdict: the sign of the votes' sum, so
    many voters cannot push one quote past one thumb."""
    with transaction.atomic():
        # The quote's row is locked first, so concurrent votes on it sum one after another.
        Generation.objects.select_for_update().filter(pk=generation_id).values_list("pk", flat=True).get()
        Vote.objects.update_or_create(
            generation_id=generation_id, client_key=client_key, defaults={"value": value}
        )
        total = Vote.objects.filter(generation_id=generation_id).aggregate(total=Sum("value"))["total"] or 0
        verdict = 1 if total > 0 else -1 if total < 0 else None
        Generation.objects.filter(pk=generation_id).update(feedback=verdict)


generation_feedback_set = sync_to_async(_generation_feedback_set)


async def generation_share(*, public_id: uuid.UUID) -> bool:
    """Mark a finished quote as shared (its Permalink or Copy button): pruning keeps it longer.
    Only the first share writes; False when there is no such quote."""
    shareable = Generation.objects.filter(public_id=public_id, status=Generation.Status.OK, is_preview=False)
    if await shareable.filter(shared_at__isnull=True).aupdate(shared_at=timezone.now()):
        return True
    return await shareable.aexists()


#: How long a row may wait for the database past a generation's end before it is taken for lost.
LOST_MARGIN_S = 60.0


def lost_before() -> dt.datetime:
    """A `running` row created before this belongs to a process that died mid-stream: no
    generation lives past the total deadline plus the resume grace."""
    longest = settings.QUOTES_POLICY.total_timeout_s + settings.QUOTES_RESUME_GRACE_S + LOST_MARGIN_S
    return timezone.now() - dt.timedelta(seconds=longest)


def generations_mark_lost() -> int:
    """The rows a dead process left `running` (killed, crashed: nothing will complete them), marked
    `error` with the code `lost` (the prune job, and each server's start, run it)."""
    return Generation.objects.filter(status=Generation.Status.RUNNING, created_at__lt=lost_before()).update(
        status=Generation.Status.ERROR,
        error_code=ErrorCode.LOST,
        error_message="The process writing this quote stopped before it ended (it was killed or crashed).",
    )
