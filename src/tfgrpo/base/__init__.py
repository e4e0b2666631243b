"""The ground floor: helpers and the compile's tracking hooks, which every other part of tfgrpo may import and
which import nothing of tfgrpo themselves."""
