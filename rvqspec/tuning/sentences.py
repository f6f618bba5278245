"""Sentences a model speaks for `rvqspec tune`: a short built-in list per language (written for rvqspec), in the
languages Qwen3-TTS supports. What the drafter learns from is the model's own codes, not the text, so a few
dozen varied sentences per language, spoken with different draws, are enough (docs/RESULTS.md, tune)."""

import itertools
from collections.abc import Iterator

from rvqspec.core.errors import RvqspecError

SENTENCES = {
    "en": ["The quick brown fox jumps over the lazy dog.", "Please call me back when you get this message.",
           "It rained all night, and the streets are still wet.", "How much does a ticket to the city centre cost?",
           "She opened the window and listened to the birds.", "We will meet at the station at half past seven.",
           "I have never seen such a beautiful sunset.", "Could you speak a little more slowly, please?",
           "The library closes early on Sundays.", "He forgot his umbrella on the train again.",
           "Thank you for waiting, your table is ready.", "The results will be announced next Tuesday.",
           "Turn left at the bakery and walk two more blocks.", "My grandmother grows tomatoes in her garden.",
           "Is this seat taken, or may I sit here?", "The concert was cancelled because of the storm."],
    "de": ["Der schnelle braune Fuchs springt über den faulen Hund.", "Bitte ruf mich zurück, wenn du Zeit hast.",
           "Es hat die ganze Nacht geregnet.", "Wie viel kostet eine Fahrkarte in die Stadt?",
           "Wir treffen uns um halb acht am Bahnhof.", "Ich habe noch nie einen so schönen Sonnenuntergang gesehen.",
           "Die Bibliothek schließt sonntags früh.", "Könnten Sie bitte etwas langsamer sprechen?",
           "Meine Großmutter pflanzt Tomaten in ihrem Garten.", "Das Konzert wurde wegen des Sturms abgesagt."],
    "es": ["El veloz zorro marrón salta sobre el perro perezoso.", "Por favor, llámame cuando recibas este mensaje.",
           "Llovió toda la noche y las calles siguen mojadas.", "¿Cuánto cuesta un billete al centro de la ciudad?",
           "Nos vemos en la estación a las siete y media.", "Nunca he visto una puesta de sol tan bonita.",
           "La biblioteca cierra temprano los domingos.", "¿Podría hablar un poco más despacio, por favor?",
           "Mi abuela cultiva tomates en su jardín.", "El concierto se canceló por la tormenta."],
    "ru": ["Быстрая коричневая лиса прыгает через ленивую собаку.", "Пожалуйста, перезвони мне, когда сможешь.",
           "Всю ночь шёл дождь, и улицы всё ещё мокрые.", "Сколько стоит билет до центра города?",
           "Встретимся на вокзале в половине восьмого.", "Я никогда не видел такого красивого заката.",
           "По воскресеньям библиотека закрывается рано.", "Не могли бы вы говорить чуть медленнее?",
           "Моя бабушка выращивает помидоры в саду.", "Концерт отменили из-за грозы."],
    "fr": ["Le rapide renard brun saute par-dessus le chien paresseux.", "Rappelle-moi quand tu auras ce message.",
           "Il a plu toute la nuit et les rues sont encore mouillées.", "Combien coûte un billet pour le centre-ville?",
           "Nous nous retrouverons à la gare à sept heures et demie.", "La bibliothèque ferme tôt le dimanche."],
    "it": ["La veloce volpe marrone salta sopra il cane pigro.", "Per favore, richiamami quando puoi.",
           "Ha piovuto tutta la notte e le strade sono ancora bagnate.", "Quanto costa un biglietto per il centro?",
           "Ci vediamo alla stazione alle sette e mezza.", "La biblioteca chiude presto la domenica."],
    "pt": ["A rápida raposa marrom pula sobre o cão preguiçoso.", "Por favor, ligue-me quando receber esta mensagem.",
           "Choveu a noite toda e as ruas ainda estão molhadas.", "Quanto custa um bilhete para o centro da cidade?",
           "Encontramo-nos na estação às sete e meia.", "A biblioteca fecha cedo aos domingos."],
    "zh": ["今天天气很好，我们去公园散步吧。", "请你收到消息以后给我回个电话。", "昨天晚上下了一夜的雨，街道还是湿的。",
           "去市中心的车票多少钱？", "我们七点半在火车站见面。", "图书馆星期天关门很早。"],
    "ja": ["今日はとても良い天気ですね。", "メッセージを聞いたら折り返し電話してください。", "一晩中雨が降って、道はまだ濡れています。",
           "市内までの切符はいくらですか。", "七時半に駅で会いましょう。", "図書館は日曜日は早く閉まります。"],
    "ko": ["오늘은 날씨가 정말 좋네요.", "메시지를 받으면 다시 전화해 주세요.", "밤새 비가 와서 길이 아직 젖어 있어요.",
           "시내까지 가는 표는 얼마예요?", "일곱 시 반에 역에서 만나요.", "도서관은 일요일에 일찍 문을 닫아요."],
}
# qwen-tts spells languages by name; the stand-in and CSM take the codes above.
LANGUAGE_NAMES = {"en": "English", "de": "German", "es": "Spanish", "ru": "Russian", "fr": "French", "it": "Italian",
                  "pt": "Portuguese", "zh": "Chinese", "ja": "Japanese", "ko": "Korean"}
# VoiceDesign models: a voice per utterance from these descriptions, in turn.
VOICE_DESCRIPTIONS = ["A calm, warm female voice, speaking at a moderate pace.",
                      "A deep male voice, clear and slightly slow.",
                      "A bright young voice, cheerful and quick.",
                      "An older narrator, soft and thoughtful."]


def sentences_for(languages: list[str]) -> list[tuple[str, str]]:
    """(language code, sentence) pairs for `languages`, round robin: any prefix covers every language."""
    lists = [(lang, SENTENCES[lang]) for lang in languages if lang in SENTENCES]
    longest = max((len(items) for _, items in lists), default=0)
    return [(lang, items[i]) for i in range(longest) for lang, items in lists if i < len(items)]


def rounds(languages: list[str]) -> Iterator[tuple[int, int, str, str]]:
    """(pass, index, language, text): the sentences again and again, each pass drawn with other seeds."""
    pairs = sentences_for(languages)
    if not pairs:
        raise RvqspecError(f"no built-in sentences for languages {', '.join(languages)}: rvqspec.tuning.sentences "
                           f"has {', '.join(LANGUAGE_NAMES)}")
    for turn in itertools.count():
        for index, (lang, text) in enumerate(pairs):
            yield turn, index, lang, text
