"""Vocabulary of the synthetic-sentences corpus, written for this project (public domain).

Plain lower-case English words that espeak-ng reads as written (no abbreviations, digits or
apostrophes), grouped by the part of speech the sentence grammar in
`rnnt.prep.synthetic_corpus` needs. Verbs list their past tense explicitly; plurals and the
third person follow regular spelling rules with the exceptions listed here. Together with the
inflected forms the grammar can say a few thousand distinct words.
"""

from __future__ import annotations

NOUNS = """
ant bat bear bee bird bison boar buffalo bull butterfly camel canary cat chicken cow crab crane
crow dog dolphin donkey dove duck eagle eel elephant falcon ferret finch flea fly fox frog
gazelle giraffe goat gorilla hamster hare hawk hedgehog hen heron horse hound jaguar kangaroo
kitten koala lamb lark leopard lion lizard llama lobster magpie mole monkey moth mule octopus
otter owl oyster panda panther parrot peacock pelican penguin pig pigeon pony puppy rabbit
raccoon rat raven robin seal shark shrimp snail snake sparrow spider squirrel stork swan tiger
toad turkey turtle walrus wasp weasel whale worm zebra
apple apricot banana bean berry biscuit cabbage cake carrot cherry cookie cracker cucumber
cupcake dumpling egg fig grape herb lemon lime mango melon muffin mushroom noodle nut olive
onion orange pancake pea peach peanut pear pepper pickle pie pizza plum pudding pumpkin radish
raisin salad sandwich sausage spice steak turnip vegetable waffle walnut
basket bath bed bench blanket bottle bowl box broom brush bucket button cabinet candle carpet
chair clock closet comb couch cup curtain cushion desk dish door drawer fork frame glass hammer
hanger jar jug kettle key ladder lamp lid lock mat mattress mirror mop mug nail napkin needle
oven pan pillow pin plate pot quilt rack rag rope rug saucer screw sink sofa spoon stool stove
table teapot towel tray tub vase wardrobe window
apron belt blouse boot bracelet cap cloak coat collar dress glove gown hat helmet jacket jewel
necklace pocket purse ring robe sandal shirt shoe skirt slipper sock stocking suit sweater tie
umbrella uniform vest wallet watch
acorn bay beach branch breeze brook bush canyon cave cliff cloud coast creek desert dune field
flame flower forest garden glacier hill hurricane island jungle lake marsh meadow moon mountain
ocean pebble petal pine plain pond puddle rainbow reef river rock root rose shadow shore slope
star stone storm stream sunrise sunset swamp thorn tide tree trunk tulip valley wave weed
willow
airport attic bakery balcony bank barn bridge cabin castle cathedral cellar chapel church
cinema city classroom college cottage court farm factory fence fountain garage gate hall
harbor hospital hotel house hut kitchen library lighthouse market mill museum office palace
park path pier playground porch prison restaurant road roof room school shop square stable
stadium station street studio temple theater tower town tunnel village wall warehouse yard zoo
actor artist aunt author baby baker banker barber boy bride brother builder butcher captain
carpenter chef clerk clown coach cook cousin customer dancer daughter dentist doctor driver
drummer engineer farmer father friend gardener ghost giant girl grandfather grandmother guard
guest guide hunter husband judge king knight lawyer leader merchant miner mother musician
neighbor nephew niece nurse officer painter passenger pilot pirate player poet porter priest
prince princess professor queen sailor scientist servant shepherd singer sister soldier son
stranger student surgeon tailor teacher tourist traveler uncle villager visitor waiter warrior
widow witch wizard writer
anchor arrow bag ball balloon banner barrel bell blade board boat bone book bow brick bubble
cage camera canoe card cart chain coin compass crown diamond drum envelope fan feather flag
flute gift globe guitar harp hook horn kite lantern letter map marble medal motor net
newspaper notebook oar paddle paper parcel pen pencil piano picture pipe plank pole postcard
puzzle radio raft ribbon rocket sail saw scale shield ship shovel sign sled spade statue stamp
string sword tent ticket toy tractor train truck trumpet tube violin wagon wheel whistle wire
ankle arm back beard belly body brain cheek chest chin ear elbow eye eyebrow face finger fist
forehead hand head heart heel hip jaw knee lip lung mouth muscle neck nose palm rib shoulder
skull spine stomach thumb toe tongue wrist
adventure afternoon answer argument autumn battle birthday century chance circle color contest
corner course danger day decade decision dinner dream duty evening event example fact failure
festival fever game gesture habit holiday hour idea journey joke language lesson meeting
memory message minute moment month morning mystery name night noise number opinion order
party pattern plan problem promise question race reason record reply result riddle rule secret
season sentence shape song sound speech story summer surprise task test thought trip victory
voice week weekend winter wish word year
airplane ambulance bicycle bus car carriage ferry helicopter jeep motorcycle scooter submarine
taxi van yacht
alarm album alley angle apartment army avenue award badge bandage basement battery beam blossom
bolt bonnet bouquet buckle bulb bundle cable calendar canal cannon canvas carton chimney cloth
comet corridor costume cradle crate crayon crystal cupboard dagger dock doll dragon engine
furnace gallery garland goblet hammock handle harness highway hive hose kennel keyboard knob
label ledge lever locket magnet mailbox mast microscope monument mural nest orchard parachute
pasture pedal pendulum pillar planet pyramid quarry railway ramp saddle satellite
scarecrow sculpture shed shell skyscraper slide socket spear staircase stage stump summit
tablet telescope thread throne torch trail trap treasure trophy vault well windmill workshop
wreath
child deer fish foot goose knife leaf man mouse ox sheep shelf thief tooth wife wolf woman
fisherman scarf potato tomato volcano hero mosquito lady
"""

# Plurals that the spelling rules in `plural()` would get wrong.
IRREGULAR_PLURALS = {
    "bison": "bison",
    "child": "children",
    "deer": "deer",
    "fish": "fish",
    "fisherman": "fishermen",
    "foot": "feet",
    "goose": "geese",
    "hero": "heroes",
    "knife": "knives",
    "leaf": "leaves",
    "man": "men",
    "mango": "mangoes",
    "mosquito": "mosquitoes",
    "mouse": "mice",
    "ox": "oxen",
    "potato": "potatoes",
    "scarf": "scarves",
    "sheep": "sheep",
    "shelf": "shelves",
    "shrimp": "shrimp",
    "thief": "thieves",
    "tomato": "tomatoes",
    "tooth": "teeth",
    "volcano": "volcanoes",
    "wife": "wives",
    "wolf": "wolves",
    "woman": "women",
}

ADJECTIVES = """
ancient angry anxious awful bald beautiful big bitter black blue bold bored brave bright
brilliant broad broken brown busy calm careful careless cheap cheerful clean clever cloudy
clumsy cold colorful comfortable common cool cozy crazy creamy crisp crooked cruel curious
curly damp dangerous dark dear deep delicate delicious dirty distant dizzy dry dull dusty eager
early easy elegant empty enormous exciting expensive faint fair famous fancy fast fat fierce
filthy fine firm flat fluffy foolish fragile free fresh friendly frozen full funny furry gentle
gigantic glad gloomy glorious golden good gorgeous graceful grand gray great greedy green
grumpy guilty happy hard harsh healthy heavy helpful helpless hidden high hollow honest hot
huge humble hungry icy important innocent jolly juicy kind large late lazy light little lively
lonely long loose loud lovely low loyal lucky magic magnificent mighty modern narrow nasty
naughty neat nervous new nice noisy odd old patient peaceful perfect pink plain pleasant polite
poor popular powerful precious pretty proud purple quick quiet rapid rare raw ready red rich
ripe rough round royal rude rusty sad safe salty sandy scary selfish serious shallow sharp
shiny short shy silent silly silver simple sleepy slim slippery slow small smart smooth soft
solid sour spicy splendid steady steep sticky stiff strange strict striped strong stubborn
sudden sunny sweet swift tall tame tasty tender terrible thick thin thirsty tidy tiny tired
tough tricky ugly upset useful vast violet warm weak wealthy weary wet white wicked wide wild
windy wise wonderful wooden worried young yellow
"""

# "base past" pairs; verbs that take an object.
TRANSITIVE_VERBS = """
accept accepted admire admired answer answered arrange arranged attack attacked bake baked
borrow borrowed bring brought build built buy bought call called carry carried catch caught
chase chased clean cleaned collect collected cook cooked count counted cover covered deliver
delivered describe described destroy destroyed discover discovered drag dragged draw drew
drink drank drive drove drop dropped eat ate enjoy enjoyed explore explored feed fed fill filled
find found fix fixed fold folded follow followed forget forgot gather gathered grab grabbed
greet greeted guard guarded hide hid hit hit hold held hug hugged hunt hunted join joined keep
kept kick kicked kiss kissed know knew lift lifted like liked lose lost love loved make made
mend mended miss missed move moved need needed notice noticed open opened paint painted pack
packed pass passed pick picked plant planted polish polished pour poured pull pulled push
pushed raise raised reach reached remember remembered repair repaired ring rang sell sold send
sent share shared shake shook sing sang steal stole sweep swept take took teach taught tear
tore throw threw tie tied touch touched trust trusted visit visited wash washed watch watched
wear wore weigh weighed win won wrap wrapped write wrote hear heard see saw meet met leave
left bite bit blow blew burn burned bury buried chew chewed choose chose close closed comb
combed copy copied crush crushed dig dug dry dried fetch fetched freeze froze heat heated knit
knitted lend lent light lit load loaded lock locked marry married measure measured melt melted
mix mixed obey obeyed offer offered own owned peel peeled place placed praise praised print
printed protect protected punish punished rescue rescued ride rode rub rubbed scrub scrubbed
seize seized sew sewed slice sliced spill spilled spread spread squeeze squeezed stir stirred
strike struck study studied tickle tickled trade traded warn warned wipe wiped guide guided
invite invited observe observed ignore ignored imagine imagined inspect inspected recognize
recognized bless blessed capture captured decorate decorated design designed examine examined
hire hired improve improved launch launched manage managed prepare prepared present presented
pursue pursued search searched serve served sketch sketched test tested weave wove scatter
scattered toss tossed juggle juggled sniff sniffed taste tasted tow towed tug tugged
"""

# "base past" pairs; verbs without an object.
INTRANSITIVE_VERBS = """
arrive arrived bark barked blink blinked breathe breathed cough coughed cry cried dance danced
disappear disappeared fall fell float floated fly flew frown frowned giggle giggled glow glowed
grin grinned grow grew hop hopped hum hummed hurry hurried jump jumped kneel knelt laugh
laughed listen listened live lived march marched nod nodded pause paused play played pray
prayed rest rested rise rose run ran rush rushed scream screamed shiver shivered shout shouted
shrug shrugged sigh sighed sit sat skip skipped sleep slept slide slid smile smiled sneeze
sneezed snore snored speak spoke stand stood stare stared stay stayed stumble stumbled swim
swam travel traveled tremble trembled wait waited walk walked wander wandered weep wept wink
winked work worked yawn yawned yell yelled argue argued vanish vanished sparkle sparkled crawl
crawled drift drifted gallop galloped wobble wobbled relax relaxed rejoice rejoiced sail sailed
shine shone sprint sprinted struggle struggled tiptoe tiptoed waddle waddled whimper whimpered
wriggle wriggled dive dived return returned hesitate hesitated complain complained agree
agreed begin began camp camped celebrate celebrated cheer cheered chuckle chuckled growl
growled howl howled leap leaped linger lingered mumble mumbled roar roared sob sobbed squeak
squeaked stroll strolled swing swung vote voted wake woke
"""

ADVERBS = """
quickly slowly quietly loudly carefully happily sadly gently suddenly finally again always
never often sometimes yesterday today tomorrow soon early late outside inside upstairs
downstairs everywhere calmly bravely eagerly proudly politely rudely softly badly barely
boldly brightly busily cheerfully clumsily eventually fiercely foolishly gladly gracefully
greedily hastily honestly hungrily lazily loosely lovingly madly merrily nervously noisily
openly patiently perfectly playfully poorly promptly rapidly rarely recklessly roughly safely
secretly seriously sharply shyly silently sleepily smoothly solemnly sternly swiftly tenderly
thoughtfully tightly truly warmly wearily wildly wisely
"""

NAMES = """
adam alice amelia andrew anna arthur benjamin betty carl caroline charles charlotte daniel
david diana dorothy edward eleanor elizabeth emily emma eric ethan frank george grace hannah
harold harry helen henry isaac isabel jack jacob james jane jennifer jessica john joseph julia
kate laura leo lily lucy margaret maria mark martha mary matthew michael nancy nathan nora
oliver oscar patrick paul peter rachel rebecca richard robert ruth samuel sarah simon sophie
susan thomas victor walter william
"""

# Prepositions that take one noun phrase and make sense of a place or direction.
PREPOSITIONS = """
in on under over near behind beside across along through into onto toward around above below
past beyond inside outside with without from
"""

# Counts for plural noun phrases ("seven old boats").
COUNT_WORDS = "two three four five six seven eight nine ten eleven twelve twenty many several few"


def words(block: str) -> tuple[str, ...]:
    return tuple(block.split())


def verb_pairs(block: str) -> tuple[tuple[str, str], ...]:
    items = block.split()
    if len(items) % 2:
        raise ValueError(f"verb list has an odd number of words ({len(items)}): base past pairs")
    return tuple(zip(items[0::2], items[1::2]))
