"""Open-ended chat prompts for making a head's training data: task templates x topics.

The class a head is trained for is open-ended chat (explain, describe, write, advise,
compare, how-to, list ideas...), so the verifier answers many varied requests of that kind.
Each template takes one kind of topic (a concept, a skill, a place, a character, a
situation, a thing); `chat_prompts(n)` returns n distinct prompts, all kinds mixed, in a
fixed shuffled order (same n and seed: same prompts). None is taken from the benchmark or
demo prompt sets (tools/prompts.py): figures are measured on prompts the head never saw.
"""

from __future__ import annotations

import random

CONCEPTS = (
    "gravity", "electricity", "magnetism", "the greenhouse effect", "plate tectonics",
    "ocean tides", "the immune system", "how the heart pumps blood", "nuclear fusion",
    "the speed of light", "rainbows", "earthquakes", "compound interest", "taxes",
    "the stock market", "a central bank", "unemployment", "globalization", "democracy",
    "the separation of powers", "the Roman Empire", "the Industrial Revolution",
    "the printing press", "the Renaissance", "the Cold War", "ancient Egypt",
    "the Silk Road", "the Great Wall of China", "the moon landing", "the Olympic Games",
    "cloud computing", "encryption", "a computer's memory", "operating systems",
    "search engines", "artificial intelligence", "blockchains", "open source software",
    "databases", "computer viruses", "binary numbers", "probability", "fractions",
    "prime numbers", "the number zero", "statistics", "algebra", "geometry",
    "climate change", "recycling", "biodiversity", "coral reefs", "rainforests", "deserts",
    "migration of birds", "hibernation", "the food chain", "fungi", "bacteria in the gut",
    "sleep cycles", "memory in the brain", "emotions", "habits", "motivation",
    "procrastination", "critical thinking", "empathy", "leadership", "teamwork",
    "negotiation", "public speaking", "time management", "minimalism", "mindfulness",
    "nutrition labels", "protein", "vitamins", "caffeine", "dehydration", "allergies",
    "antibiotics", "the placebo effect", "jazz music", "classical music", "impressionism",
    "poetry", "mythology", "folk tales", "architecture", "photography", "film editing",
    "video games", "board games", "chess openings", "the history of football",
    "electric cars", "solar panels", "wind turbines", "batteries", "3D printing",
    "satellites", "GPS", "telescopes", "microscopes", "the periodic table", "acids and bases",
    "evaporation", "friction", "sound waves", "the human eye", "volcanoes", "glaciers",
    "the ozone layer", "urban planning", "public transport", "libraries", "museums",
    "translation between languages", "dialects", "the alphabet", "writing systems",
    "inflation", "budgets", "insurance", "supply chains", "advertising", "brands",
    "social media", "online privacy", "passwords", "spam email", "remote work",
    "the scientific method", "peer review", "ethics", "free will", "happiness",
    "friendship", "curiosity", "boredom", "creativity", "humor",
)

SKILLS = (
    "bake sourdough bread", "learn to juggle", "start running", "grow tomatoes on a balcony",
    "write a resume", "save money each month", "learn to swim as an adult", "meditate",
    "take better photos with a phone", "organize a closet", "plan a wedding on a budget",
    "train a puppy", "care for a houseplant", "change a flat tire", "learn to draw",
    "write a novel", "learn to play the guitar", "make friends in a new city",
    "prepare for a marathon", "cook rice perfectly", "brew tea", "clean a kitchen quickly",
    "learn to code", "study for an exam", "speak up in meetings", "give feedback kindly",
    "negotiate a salary", "start a small business", "keep a journal", "wake up early",
    "reduce screen time", "learn to knit", "build a birdhouse", "paint a room",
    "set up a home office", "plan a road trip", "pack a suitcase", "make a budget",
    "learn a new language", "memorize a speech", "start a podcast", "write a blog post",
    "host a dinner party", "make homemade pizza", "fix a leaky faucet", "compost food waste",
    "sharpen a kitchen knife", "ride a bike in traffic", "stay warm while camping",
    "choose a good book", "teach a child to read", "deal with a difficult coworker",
    "apologize sincerely", "say no politely", "stay calm in an argument", "learn to dance",
    "make a smoothie", "prepare a healthy lunch", "start stretching every day",
    "sleep better in hot weather", "recover after a long trip", "volunteer in my community",
    "declutter a garage", "write a thank-you letter", "make a podcast interview",
    "plan a surprise party", "choose a laptop", "back up my files", "learn touch typing",
)

PLACES = (
    "a busy train station", "a quiet mountain village", "an old library", "a night market",
    "a coral reef", "a space station", "a rainforest at dawn", "a desert oasis",
    "a medieval castle", "a small bakery", "a snowy forest", "a fishing harbor",
    "a city rooftop garden", "an abandoned amusement park", "a science museum",
    "a farm in spring", "a lighthouse island", "a jazz club", "a school playground",
    "an airport at midnight", "a hospital waiting room", "a bookshop cafe",
    "a volcanic island", "the bottom of the ocean", "a busy kitchen", "a football stadium",
    "a public park on Sunday", "a ski resort", "a cave with glowing crystals",
    "a floating city", "a flower market", "a train crossing the countryside",
)

CHARACTERS = (
    "a shy astronaut", "a retired detective", "a talking fox", "a young inventor",
    "a lonely robot", "a grandmother who runs a bakery", "a lost penguin",
    "a street musician", "a dragon who collects books", "a forgetful wizard",
    "a brave mail carrier", "a clumsy knight", "a curious squirrel", "a tired firefighter",
    "a ghost who is afraid of people", "a girl who can talk to plants", "a time traveler",
    "a chef who lost his sense of taste", "a pirate who hates the sea", "a new teacher",
    "an old tree", "a cat who wants to be a dog", "twin sisters on an adventure",
    "a boy who finds a secret door", "a scientist on a deserted island", "a kind giant",
    "a rabbit who cannot sleep", "an owl who runs a school", "a snowman in summer",
    "a queen who gives up her crown", "a small boat in a storm", "a star that fell to Earth",
)

SITUATIONS = (
    "asking a landlord to fix the heating", "inviting colleagues to a team lunch",
    "thanking a friend for their help", "rescheduling a meeting", "requesting a refund",
    "introducing myself to a new team", "congratulating a friend on a promotion",
    "asking a professor for an extension", "welcoming a new neighbor",
    "declining a job offer politely", "following up after an interview",
    "asking for a recommendation letter", "complaining about a late delivery",
    "announcing a product launch", "inviting family to a birthday party",
    "apologizing for missing a deadline", "asking a coworker to cover a shift",
    "proposing a new idea to my boss", "canceling a gym membership",
    "organizing a charity bake sale", "reminding a client about an unpaid invoice",
)

THINGS = (
    "a smartphone", "a bicycle", "a coffee maker", "an umbrella", "a wristwatch",
    "a backpack", "a pair of running shoes", "a desk lamp", "a houseplant", "a notebook",
    "a teapot", "a rain jacket", "a kitchen knife", "a board game", "a telescope",
    "a sleeping bag", "a bookshelf", "a blender", "a fountain pen", "a sun hat",
    "headphones", "a camera", "a yoga mat", "a lunch box", "a candle", "a kite",
)

PAIRS = (
    ("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "films"),
    ("city life", "country life"), ("renting", "buying a home"), ("running", "swimming"),
    ("paper books", "e-readers"), ("solar power", "wind power"), ("summer", "winter"),
    ("working from home", "working in an office"), ("Python", "JavaScript"),
    ("the sun", "the moon"), ("frogs", "toads"), ("weather", "climate"),
    ("saving", "investing"), ("a laptop", "a desktop computer"), ("baking", "frying"),
    ("mountains", "beaches"), ("a novel", "a short story"), ("rivers", "lakes"),
    ("introverts", "extroverts"), ("chess", "checkers"), ("violins", "cellos"),
    ("hurricanes", "tornadoes"), ("emails", "phone calls"), ("yoga", "pilates"),
)

TEMPLATES = {
    "concept": (
        "Explain {x} in simple terms.",
        "Can you explain {x} to a twelve-year-old?",
        "What is the most surprising thing about {x}?",
        "Give me a short overview of {x}.",
        "Why does {x} matter in everyday life?",
        "Write a short paragraph introducing {x}.",
        "What are common misconceptions about {x}?",
        "Summarize what people should know about {x}.",
        "Write a short poem about {x}.",
        "List five interesting facts about {x}.",
        "How would you teach {x} to a beginner?",
        "What questions do students often ask about {x}? Answer two of them.",
        "Describe the history of {x} briefly.",
        "Write a short blog post about {x}.",
    ),
    "skill": (
        "How do I {x}?",
        "Give me step-by-step instructions to {x}.",
        "What are the most common mistakes people make when they try to {x}?",
        "I want to {x}. Where should I start?",
        "Give me five tips to {x}.",
        "Write a short guide for beginners who want to {x}.",
        "What do I need to {x}? Make a list.",
        "My friend wants to {x}. What advice would you give them?",
    ),
    "place": (
        "Describe {x} in vivid detail.",
        "Write a short story set in {x}.",
        "Write a poem about {x}.",
        "Describe the sounds and smells of {x}.",
        "Imagine you are visiting {x}. Describe your day.",
        "Write the opening paragraph of a novel set in {x}.",
    ),
    "character": (
        "Write a short story about {x}.",
        "Write a bedtime story about {x}.",
        "Write a funny poem about {x}.",
        "Write a dialogue between {x} and a child.",
        "Describe a day in the life of {x}.",
        "Write a fable about {x} with a moral at the end.",
        "Tell me a short adventure story starring {x}.",
    ),
    "situation": (
        "Write an email {x}.",
        "Write a short, friendly message {x}.",
        "Help me write a polite letter {x}.",
        "Draft a text message {x}.",
    ),
    "thing": (
        "Write a product description for {x}.",
        "What should I look for when buying {x}?",
        "Write a short poem from the point of view of {x}.",
        "List ten creative uses for {x}.",
        "Describe how {x} is made.",
        "Write a short advertisement for {x}.",
        "How do I take care of {x} so it lasts longer?",
    ),
    "pair": (
        "Compare {a} and {b}.",
        "What are the pros and cons of {a} versus {b}?",
        "Which is better, {a} or {b}? Explain your reasoning.",
        "What do {a} and {b} have in common, and how are they different?",
        "Write a short debate between someone who prefers {a} and someone who prefers {b}.",
    ),
}

_TOPICS = {"concept": CONCEPTS, "skill": SKILLS, "place": PLACES, "character": CHARACTERS,
           "situation": SITUATIONS, "thing": THINGS, "pair": PAIRS}


def all_prompts() -> list[str]:
    """Every template x topic combination of its kind, in a fixed order."""
    out = []
    for kind, templates in TEMPLATES.items():
        for topic in _TOPICS[kind]:
            for t in templates:
                if kind == "pair":
                    out.append(t.format(a=topic[0], b=topic[1]))
                else:
                    text = t.format(x=topic)
                    out.append(text[0].upper() + text[1:])
    return out


def chat_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """n distinct prompts (all when n is None or larger than the set), in a fixed shuffled
    order that mixes the kinds and topics; a smaller n is a prefix of a larger one."""
    prompts = sorted(set(all_prompts()))
    random.Random(seed).shuffle(prompts)
    return prompts if n is None else prompts[:n]
