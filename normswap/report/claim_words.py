"""The report kit's verdict words: what a claim's evidence says, in the same words on every page
(eval report's claims vs measured, the study's claims and bottom line), and how a page colours them."""

REPRODUCED, NOT_REPRODUCED, NOT_MEASURABLE = "reproduced", "not reproduced", "not measurable here"
# the badge a verdict wears on the HTML page (page.css): any other verdict is neutral
VERDICT_CLASS = {REPRODUCED: "v-yes", NOT_REPRODUCED: "v-no"}
