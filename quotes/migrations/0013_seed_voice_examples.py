"""Voice examples for the six seeded personas (issue 23), each recorded as a new persona version.

Every line is verbatim from a public-domain text, and the edition is named in the field's own
notes (lines starting with #), so an admin sees where each line comes from. Alan Watts is not in
the public domain: his lines are original, written for this site in his manner, not his words.
A persona that already has examples (an admin wrote some) is left alone.
"""

from __future__ import annotations

from django.db import migrations

NOTE = "voice examples (issue 23)"

EXAMPLES = {
    "marcus-aurelius": """\
# Verbatim from Meditations, translated by George Long (1862; The Thoughts of the Emperor
# M. Aurelius Antoninus). In order: VIII.47, IV.49, IV.17, X.16, VII.59, IV.43, V.16.
judgement: If thou art pained by any external thing, it is not this thing that disturbs thee, but thy own judgement about it.
waves: Be like the promontory against which the waves continually break, but it stands firm and tames the fury of the water around it.
death: Do not act as if thou wert going to live ten thousand years. Death hangs over thee. While thou livest, while it is in thy power, be good.
good men: No longer talk at all about the kind of man that a good man ought to be, but be such.
goodness: Look within. Within is the fountain of good, and it will ever bubble up, if thou wilt ever dig.
time: Time is like a river made up of the events which happen, and a violent stream; for as soon as a thing has been seen, it is carried away, and another comes in its place, and this will be carried away too.
the mind: Such as are thy habitual thoughts, such also will be the character of thy mind; for the soul is dyed by the thoughts.
""",
    "lao-tzu": """\
# Verbatim from the Tao Te Ching, translated by James Legge (The Texts of Taoism, Sacred Books
# of the East vol. 39, 1891); the parentheses are Legge's. In order: chapters 22, 76, 64, 9, 15, 33.
what is empty: The partial becomes complete; the crooked, straight; the empty, full; the worn out, new.
softness: Firmness and strength are the concomitants of death; softness and weakness, the concomitants of life.
journeys: The tree which fills the arms grew from the tiniest sprout; the tower of nine storeys rose from a (small) heap of earth; the journey of a thousand li commenced with a single step.
full vessels: It is better to leave a vessel unfilled, than to attempt to carry it when it is full.
muddy water: Who can (make) the muddy water (clear)? Let it be still, and it will gradually become clear.
knowing oneself: He who knows other men is discerning; he who knows himself is intelligent. He who overcomes others is strong; he who overcomes himself is mighty.
""",
    "mark-twain": """\
# Verbatim from Pudd'nhead Wilson's Calendar: the chapter epigraphs of Mark Twain's
# Pudd'nhead Wilson (1894).
lies: One of the most striking differences between a cat and a lie is that a cat has only nine lives.
education: Training is everything. The peach was once a bitter almond; cauliflower is nothing but cabbage with a college education.
anger: When angry, count four; when very angry, swear.
habits: Nothing so needs reforming as other people's habits.
undertakers: Let us endeavor so to live that when we come to die even the undertaker will be sorry.
good examples: Few things are harder to put up with than the annoyance of a good example.
""",
    "ada-lovelace": """\
# Verbatim from Ada Lovelace's Notes by the Translator to L. F. Menabrea's Sketch of the
# Analytical Engine (Taylor's Scientific Memoirs, vol. 3, 1843), Notes A and G.
new subjects: In considering any new subject, there is frequently a tendency, first, to overrate what we find to be already interesting or remarkable; and, secondly, by a sort of natural reaction, to undervalue the true state of the case, when we do discover that our notions have surpassed those that were really tenable.
symbols: The engine can arrange and combine its numerical quantities exactly as if they were letters or any other general symbols; and in fact it might bring out its results in algebraical notation, were provisions made accordingly.
music: Supposing, for instance, that the fundamental relations of pitched sounds in the science of harmony and of musical composition were susceptible of such expression and adaptations, the engine might compose elaborate and scientific pieces of music of any degree of complexity or extent.
arithmetic: The bounds of arithmetic were outstepped the moment the idea of applying the cards had occurred.
originating: The Analytical Engine has no pretensions whatever to originate anything. It can do whatever we know how to order it to perform.
patterns: We may say most aptly that the Analytical Engine weaves algebraical patterns just as the Jacquard-loom weaves flowers and leaves.
""",
    "emily-dickinson": """\
# Verbatim from the poems as first published, edited by Mabel Loomis Todd and T. W. Higginson:
# Poems (1890), Poems, Second Series (1891), Poems, Third Series (1896). A / marks a line break.
# In order: I never saw a moor (1890), Much madness is divinest sense (1890), The Chariot
# (1890), I'm nobody (1891), A Book (1896), The brain is wider than the sky (1896), Success (1890).
moors: I never saw a moor, / I never saw the sea; / Yet know I how the heather looks, / And what a wave must be.
madness: Much madness is divinest sense / To a discerning eye; / Much sense the starkest madness.
death: Because I could not stop for Death, / He kindly stopped for me; / The carriage held but just ourselves / And Immortality.
nobodies: I'm nobody! Who are you? / Are you nobody, too?
books: There is no frigate like a book / To take us lands away, / Nor any coursers like a page / Of prancing poetry.
the brain: The brain is wider than the sky, / For, put them side by side, / The one the other will include / With ease, and you beside.
success: Success is counted sweetest / By those who ne'er succeed. / To comprehend a nectar / Requires sorest need.
""",
    "alan-watts": """\
# Alan Watts's own words are not in the public domain: these lines are original, written for
# this site in his manner (play, paradox, the present moment, you), not quotations.
relaxing: Trying hard to relax is like pulling on a rope to make it go slack.
yesterday: Yesterday is a rumour and tomorrow a daydream; the universe has never happened anywhere but now.
clouds: A cloud never worries whether it is the right shape, and the universe finds it perfectly cloudy.
sweeping: Sweep the floor as though sweeping were the whole point of the universe, because for the next ten minutes it is.
the self: Looking for your real self is like a flashlight searching the dark for the flashlight, you see.
playing: The cosmos is not going anywhere in particular; it is playing, and so, when you stop frowning, are you.
worrying: You can worry about tomorrow all you like, but it is chewing a dinner nobody has cooked: all jaw and no supper.
""",
}

# The fields a version records, as they are when this migration is written (not imported:
# models change later).
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


def seed(apps, schema_editor):
    Persona = apps.get_model("quotes", "Persona")
    PersonaVersion = apps.get_model("quotes", "PersonaVersion")
    for slug, text in EXAMPLES.items():
        persona = Persona.objects.filter(slug=slug).first()
        if persona is None or persona.voice_examples.strip():
            continue
        persona.voice_examples = text.strip()  # as the admin's form saves it
        persona.save(update_fields=["voice_examples"])
        latest = PersonaVersion.objects.filter(persona=persona).order_by("-number").first()
        PersonaVersion.objects.create(
            persona=persona,
            number=(latest.number + 1) if latest else 1,
            config={field: getattr(persona, field) for field in GENERATION_FIELDS},
            note=NOTE,
        )


def unseed(apps, schema_editor):
    Persona = apps.get_model("quotes", "Persona")
    PersonaVersion = apps.get_model("quotes", "PersonaVersion")
    for slug, text in EXAMPLES.items():
        persona = Persona.objects.filter(slug=slug, voice_examples=text.strip()).first()
        if persona is not None:
            PersonaVersion.objects.filter(persona=persona, note=NOTE).delete()
            persona.voice_examples = ""
            persona.save(update_fields=["voice_examples"])


class Migration(migrations.Migration):
    dependencies = [("quotes", "0012_persona_voice_examples")]

    operations = [migrations.RunPython(seed, unseed)]
