"""Task templates over word lists: prompts of the kinds people ask a chat model.

Used beside the target's own Magpie questions (`specdec.train.magpie`) for broad
self-distillation data. Categories: writing, role-play, reasoning, math word problems,
code in several languages, extraction, STEM, humanities, translation, and tasks over a
passage (summaries, questions, extraction) whose passage the target writes first
(`passage_requests` / `over_passage`). Every word list here was written for this module;
no benchmark's questions are used.
"""

from __future__ import annotations

import random

TOPICS = [
    "the ocean", "a small village", "climate change", "the history of bread", "space exploration", "friendship",
    "a rainy city", "electric cars", "honeybees", "the first day of school", "a lighthouse keeper", "volcanoes",
    "remote work", "the Roman Empire", "a lost dog", "coffee", "mountain hiking", "artificial intelligence",
    "recycling", "a jazz musician", "the moon", "a busy market", "chess", "public libraries", "winter", "robots",
    "a family dinner", "the printing press", "coral reefs", "a train journey", "gardening", "social media",
    "a museum at night", "the water cycle", "a young inventor", "ancient Egypt", "solar power", "a thunderstorm",
    "learning a language", "the internet", "a bakery", "deserts", "the Olympic Games", "a city park", "dinosaurs",
    "sleep", "a football match", "time travel", "bicycles", "the human brain", "a forest fire", "music festivals",
]
FORMS = ["a short poem", "a haiku", "a short story", "a limerick", "a diary entry", "a persuasive paragraph",
         "a product description", "a formal letter", "a blog post introduction", "a speech opening", "a fable",
         "a news headline and lead paragraph", "a motivational message", "a dialogue between two friends",
         "an email to a colleague", "a tweet", "a song chorus", "a review", "a recipe introduction", "a riddle"]
ROLES = ["a pirate captain", "a medieval knight", "a travel guide in Paris", "a detective", "a friendly robot",
         "a chef", "a history teacher", "a personal trainer", "a customer service agent", "an astronaut on Mars",
         "a wise old wizard", "a sports commentator", "a museum guide", "a job interviewer", "a doctor",
         "a librarian", "a tour guide in Tokyo", "a startup founder", "a park ranger", "a poet"]
ROLE_ASKS = ["introduce yourself", "give me advice about {topic}", "describe your typical day",
             "tell me a story about {topic}", "answer my question: what do you think about {topic}?",
             "explain {topic} to a child", "convince me to care about {topic}"]
LANGUAGES = ["Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "SQL", "Bash", "TypeScript", "Ruby", "C#"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n", "finds the largest "
    "element of a list", "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a "
    "list", "computes the n-th Fibonacci number", "checks whether a string is a palindrome", "sorts a list with "
    "bubble sort", "implements binary search", "reads a file and counts its lines", "converts Celsius to "
    "Fahrenheit", "finds the greatest common divisor of two numbers", "flattens a nested list", "counts word "
    "frequencies in a text", "validates an email address", "implements a stack", "implements a queue with two "
    "stacks", "returns the sum of the digits of a number", "checks whether two strings are anagrams",
    "computes the average of a list of numbers", "generates all permutations of a list", "parses a CSV line",
    "rotates a matrix by 90 degrees", "finds the second largest number in a list", "implements a linked list",
    "converts a decimal number to binary", "counts the words in a sentence", "checks for balanced parentheses",
]
CODE_ASKS = ["Write a {lang} function that {task}.", "How do I write a {lang} program that {task}?",
             "Show me {lang} code that {task}, with comments.",
             "Explain how to write a function in {lang} that {task}.",
             "Write a {lang} function that {task}, and explain its time complexity."]
CONCEPTS_STEM = [
    "photosynthesis", "gravity", "the theory of evolution", "DNA replication", "black holes", "the Pythagorean "
    "theorem", "entropy", "electric current", "the periodic table", "vaccines", "plate tectonics", "Newton's laws "
    "of motion", "the speed of light", "machine learning", "prime numbers", "the greenhouse effect", "atoms",
    "the immune system", "probability", "recursion", "cloud computing", "quantum computers", "the big bang",
    "chemical bonds", "sound waves", "the circulatory system", "compound interest", "algorithms", "magnetism",
    "nuclear energy", "the metric system", "blockchain", "antibiotics", "derivatives in calculus", "encryption",
]
CONCEPTS_HUM = [
    "the French Revolution", "democracy", "the Renaissance", "stoicism", "the Industrial Revolution", "impressionism",
    "the Cold War", "utilitarianism", "the Silk Road", "the Great Depression", "Shakespeare's influence",
    "the civil rights movement", "existentialism", "the fall of the Berlin Wall", "globalization", "human rights",
    "the scientific revolution", "Greek mythology", "the Magna Carta", "colonialism", "free will", "inflation",
    "supply and demand", "the United Nations", "minimalism", "the role of museums", "cultural heritage",
]
STEM_ASKS = ["Explain {c} in simple terms.", "What is {c}?", "How does {c} work?", "Why is {c} important?",
             "Give me three facts about {c}.", "Explain {c} to a high school student.",
             "What are the main ideas behind {c}?", "What are common misconceptions about {c}?"]
HUM_ASKS = ["What were the causes of {c}?", "Explain {c} in a few paragraphs.", "Why does {c} matter today?",
            "Summarize the key ideas of {c}.", "What are the arguments for and against {c}?",
            "Describe the impact of {c}.", "Write a short essay about {c}."]
REASONING = [
    "If all {a} are {b} and some {b} are {c}, can we conclude that some {a} are {c}? Explain.",
    "Which is heavier, a kilogram of {a} or a kilogram of {b}? Explain your reasoning.",
    "I have {n} {a}. I give away half and then buy {m} more. How many do I have?",
    "What are the pros and cons of {t}?", "Should I choose {a} or {b}? Help me decide.",
    "Compare {a} and {b}.", "What would happen if {t} disappeared overnight?",
    "Give me a step-by-step plan to learn about {t}.", "Solve this riddle: what has keys but can't open locks?",
]
THINGS = ["apples", "books", "cats", "cars", "feathers", "bricks", "pencils", "trees", "stars", "coins", "shoes",
          "birds", "teachers", "students", "phones", "chairs", "rivers", "cookies", "tickets", "marbles"]
NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "James", "Kenji", "Lena",
         "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
MATH = [
    "{p} has {a} {x}. {p} buys {b} more and gives {c} to a friend. How many {x} does {p} have now?",
    "A store sells {x} for ${a} each. {p} buys {b} of them and pays with ${d}. How much change does {p} get?",
    "{p} reads {a} pages a day. How many days does it take to finish a book of {e} pages?",
    "A train travels at {a} km per hour for {b} hours. How far does it go?",
    "{p} earns ${a} per hour and works {b} hours a week. How much does {p} earn in {c} weeks?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "There are {e} {x} in a box. {p} puts them into bags of {b}. How many full bags are there, and how many {x} "
    "are left?", "What is {a}% of {e}?", "Solve for x: {a}x + {b} = {e}.",
    "{p} is {a} years old. {p}'s mother is {b} years older than {c} times {p}'s age. How old is she?",
    "The price of a jacket is ${e}. It is on sale for {a}% off. What is the sale price?",
    "A recipe needs {a} cups of flour for {b} people. How much flour is needed for {c} people?",
]
# Source sentences for translation prompts, written for this module.
FOREIGN = {
    "German": ["Das Wetter ist heute sehr schön, deshalb gehen wir in den Park.",
               "Ich habe gestern ein interessantes Buch über die Geschichte Europas gelesen.",
               "Die Regierung hat neue Regeln für den Verkehr in der Innenstadt beschlossen.",
               "Meine Schwester arbeitet als Ärztin in einem großen Krankenhaus in Berlin.",
               "Kannst du mir bitte sagen, wie ich zum Bahnhof komme?",
               "Das Unternehmen plant, im nächsten Jahr hundert neue Mitarbeiter einzustellen.",
               "Wir haben uns sehr über euren Besuch gefreut.",
               "Die Preise für Lebensmittel sind in den letzten Monaten stark gestiegen.",
               "Nach dem Abendessen spielen die Kinder noch eine Stunde im Garten.",
               "Der Zug hatte wegen eines technischen Problems zwanzig Minuten Verspätung."],
    "French": ["Je voudrais réserver une table pour deux personnes ce soir.",
               "La ville a construit une nouvelle bibliothèque près de la rivière.",
               "Nous partons en vacances à la montagne la semaine prochaine.",
               "Le musée est fermé le lundi mais ouvert tous les autres jours.",
               "Les élèves ont préparé un spectacle pour la fin de l'année."],
    "Spanish": ["Mañana vamos a visitar a mis abuelos en el campo.",
                "El restaurante de la esquina tiene la mejor comida de la ciudad.",
                "Necesito comprar un regalo para el cumpleaños de mi hermano.",
                "La reunión empezará a las diez de la mañana.",
                "Los científicos descubrieron una nueva especie de rana en la selva."],
}
TRANSLATE_ASKS = ["Translate the following sentence into English: {s}", "Translate to English: {s}",
                  "What does this {lang} sentence mean in English? {s}",
                  "Please translate this {lang} text into English.\n\n{s}"]
ENGLISH = ["The meeting has been moved to Thursday afternoon.", "I love walking by the sea in the morning.",
           "Could you help me find the train station?", "The children are playing football in the garden.",
           "Our company opened a new office last year.", "Reading books is my favourite hobby."]
EXTRACT = ["List all the numbers mentioned in this text: {s}", "Extract the names of people and places from: {s}",
           "What is the main verb in this sentence? {s}", "Rewrite this sentence in the passive voice: {s}",
           "Correct the grammar of this sentence: {s}", "Make this sentence more formal: {s}"]
PASSAGE_KINDS = ["a short news article", "an encyclopedia paragraph", "a short report", "a short essay",
                 "a product announcement", "a short biography of a fictional person", "a travel guide paragraph"]
OVER_PASSAGE = [
    ("summary", "Summarize the following text in a few sentences.\n\n{p}"),
    ("summary", "{p}\n\nWrite a one-paragraph summary of the text above."),
    ("summary", "Give me the key points of this article:\n\n{p}"),
    ("qa", "Read the passage and answer the question.\n\nPassage: {p}\n\nQuestion: What is the main topic of the "
           "passage, and what are its most important details?"),
    ("qa", "{p}\n\nBased on the text above, what happened and why does it matter?"),
    ("qa", "Use the following information to answer: who or what is this text about?\n\n{p}"),
    ("extraction", "Extract every name, date and number from this text as a list.\n\n{p}"),
    ("extraction", "{p}\n\nWrite three questions that this text answers, with their answers."),
]


def _one(rng: random.Random) -> tuple[str, str]:
    kind = rng.choice(["writing", "roleplay", "reasoning", "math", "code", "code", "stem", "humanities",
                       "translation", "extraction"])
    t = rng.choice(TOPICS)
    if kind == "writing":
        return kind, rng.choice(["Write {f} about {t}.", "Can you write {f} about {t}?", "Compose {f} on {t}.",
                                 "I need {f} about {t}. Keep it short."]).format(f=rng.choice(FORMS), t=t)
    if kind == "roleplay":
        ask = rng.choice(ROLE_ASKS).format(topic=t)
        return kind, f"Pretend you are {rng.choice(ROLES)}. {ask[0].upper() + ask[1:]}."
    if kind == "reasoning":
        a, b, c = rng.sample(THINGS, 3)
        return kind, rng.choice(REASONING).format(a=a, b=b, c=c, t=t, n=2 * rng.randint(2, 20), m=rng.randint(1, 9))
    if kind == "math":
        i, j, m = rng.randint(2, 40), rng.randint(2, 12), rng.randint(2, 6)
        return kind, rng.choice(MATH).format(p=rng.choice(NAMES), x=rng.choice(THINGS), a=i, b=j, c=m,
                                             d=i * j + rng.choice([5, 10, 20, 50]), e=rng.randint(50, 600))
    if kind == "code":
        return kind, rng.choice(CODE_ASKS).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS))
    if kind == "stem":
        return kind, rng.choice(STEM_ASKS).format(c=rng.choice(CONCEPTS_STEM))
    if kind == "humanities":
        return kind, rng.choice(HUM_ASKS).format(c=rng.choice(CONCEPTS_HUM))
    if kind == "translation":
        if rng.random() < 0.8:
            lang = rng.choice(list(FOREIGN))
            return kind, rng.choice(TRANSLATE_ASKS).format(s=rng.choice(FOREIGN[lang]), lang=lang)
        lang = rng.choice(list(FOREIGN))
        return kind, f"Translate into {lang}: {rng.choice(ENGLISH)}"
    sentences = ENGLISH + [s for v in FOREIGN.values() for s in v][:3]
    return "extraction", rng.choice(EXTRACT).format(s=rng.choice(sentences))


def task_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """n (category, prompt) pairs, distinct where the lists allow."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for _ in range(20 * n):
        if len(out) >= n:
            break
        kind, text = _one(rng)
        if text not in seen:
            seen.add(text)
            out.append((kind, text))
    return out


def passage_requests(n: int, seed: int = 0) -> list[str]:
    """Requests whose answers become passages for `over_passage`."""
    rng = random.Random(seed + 1)
    return [f"Write {rng.choice(PASSAGE_KINDS)} about {rng.choice(TOPICS)}." for _ in range(n)]


def over_passage(passages: list[str], seed: int = 0) -> list[tuple[str, str]]:
    """(category, prompt) pairs asking for a summary, answers or extraction over each passage."""
    rng = random.Random(seed + 2)
    out = []
    for p in passages:
        kind, template = rng.choice(OVER_PASSAGE)
        out.append((kind, template.format(p=p.strip())))
    return out
